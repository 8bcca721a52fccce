"""A generated corpus of short stories, a word-level tokenizer for it, and a small model trained on it.

The stories come from a small grammar with structure a language model can learn, and that needs
the context (so the KV cache) to predict well:
- characters, a city, a pet and an object are introduced, then referred to again later;
- pronouns agree with each character (she/he), and verbs with the pet's number (barks/bark);
- counting runs "one two three ..." to a length set earlier in the story.
Everything is seeded, so every run builds the same text, tokenizer and model.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import torch

WOMEN = ["anna", "beth", "clara", "dora", "emma", "fiona", "grace", "helen", "iris", "julia", "kate", "lucy",
         "maria", "nora", "olga", "paula", "rosa", "sara", "tina", "vera"]
MEN = ["adam", "bruno", "carl", "david", "edgar", "felix", "george", "henry", "ivan", "jack", "karl", "leo",
       "mark", "nick", "oscar", "peter", "ralph", "sam", "tom", "victor"]
CITIES = ["paris", "rome", "oslo", "lima", "cairo", "delhi", "tokyo", "berlin", "madrid", "dublin", "vienna",
          "prague", "quito", "seoul", "sydney", "boston"]
PETS = [("dog", "dogs", "barks", "bark"), ("cat", "cats", "purrs", "purr"), ("bird", "birds", "sings", "sing"),
        ("horse", "horses", "runs", "run"), ("goat", "goats", "jumps", "jump"), ("fish", "fishes", "swims", "swim")]
OBJECTS = ["hat", "book", "lamp", "ring", "clock", "kite", "cup", "coat", "bag", "box", "pen", "map", "key",
           "drum", "vase", "sword"]
COLOURS = ["red", "blue", "green", "white", "black", "yellow", "brown", "purple", "golden", "silver"]
JOBS = ["baker", "doctor", "farmer", "teacher", "painter", "sailor", "singer", "tailor", "writer", "pilot",
        "nurse", "judge"]
PLACES = ["market", "station", "library", "harbour", "museum", "garden", "bakery", "school", "bridge", "park"]
WEATHER = ["cold", "warm", "rainy", "sunny", "windy", "grey", "quiet", "busy"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3


def story(rng: random.Random) -> str:
    """One story of about a hundred words."""
    first, second = rng.sample([(n, "she", "her") for n in WOMEN] + [(n, "he", "his") for n in MEN], 2)
    name, pronoun, possessive = first
    friend, friend_pronoun, _ = second
    city, place = rng.choice(CITIES), rng.choice(PLACES)
    pet, pets, sound, sound_plural = rng.choice(PETS)
    several = rng.random() < 0.5
    count = rng.randrange(2, 8)
    thing, colour, job = rng.choice(OBJECTS), rng.choice(COLOURS), rng.choice(JOBS)
    the_pet = f"the {pets}" if several else f"the {pet}"
    pet_verb = sound_plural if several else sound
    pet_was = "were" if several else "was"

    opening = [
        f"{name} lived in {city} with {NUMBERS[rng.randrange(1, 4)] + ' ' + pets if several else 'a ' + pet} .",
        f"{pronoun} worked as a {job} .",
    ]
    middle = [
        f"one day {name} met {friend} at the {place} .",
        f"{friend} had a {colour} {thing} .",
        f"{friend_pronoun} gave the {colour} {thing} to {name} .",
        f"{name} took the {thing} home to {city} .",
    ]
    fillers = [
        f"the weather in {city} was {rng.choice(WEATHER)} .",
        f"{the_pet} {pet_verb} at night .",
        f"{possessive} {pet if not several else pets} {pet_was} {rng.choice(['happy', 'tired', 'hungry', 'calm'])} .",
        f"{name} was a good {job} .",
        f"{friend} went back to the {place} .",
    ]
    ending = [
        f"{name} counted {NUMBERS[count - 1]} days : {' '.join(NUMBERS[:count])} .",
        f"then {pronoun} put the {colour} {thing} on the table .",
        f"{the_pet} {pet_verb} at the {thing} .",
        f"{name} and {friend} were friends .",
        "the end .",
    ]
    body = list(middle)
    for filler in rng.sample(fillers, rng.randrange(2, len(fillers) + 1)):
        body.insert(rng.randrange(1, len(body) + 1), filler)
    return " ".join(opening + body + ending)


def corpus(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [story(rng) for _ in range(count)]


def build_tokenizer(directory: Path, texts: list[str]):
    """A word-level tokenizer over the words of ``texts``, saved to ``directory`` as tokenizer.json.

    Ids are fixed: the special tokens first, then words by falling frequency (ties alphabetical).
    Encoding puts <s> first, as every story starts in training.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    counts = Counter(word for text in texts for word in text.split())
    words = sorted(counts, key=lambda word: (-counts[word], word))
    raw = Tokenizer(models.WordLevel({token: i for i, token in enumerate(SPECIALS + words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    raw.decoder = decoders.WordPiece(prefix="##")  # joins word tokens with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(directory)
    return tokenizer


def train_llama(directory: Path, token_stream: torch.Tensor, vocab_size: int, *, steps: int, seed: int = 0,
                seq_len: int = 128, batch_size: int = 16) -> float:
    """Train a 2-layer Llama on random windows of ``token_stream`` and save it to ``directory``.

    Two heads of 64 make head_dim 64, so a group of 64 spans one head's key or value. Returns the
    mean training loss of the last 50 steps.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        head_dim=64, intermediate_size=384, max_position_embeddings=256, rms_norm_eps=1e-5,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(steps):
        offsets = torch.randint(0, len(token_stream) - seq_len, (batch_size,), generator=generator)
        batch = torch.stack([token_stream[o:o + seq_len] for o in offsets.tolist()])  # (batch, seq_len)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    model.save_pretrained(directory)
    return sum(losses[-50:]) / len(losses[-50:])
