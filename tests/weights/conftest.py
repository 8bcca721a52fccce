"""Tiny GGUF files of one random Llama model, one per matrix type, written once per session."""

import pytest

from tests.weights.gguf_files import MATRIX_TYPES, bpe_tokenizer, tiny_llama, write_gguf


@pytest.fixture(scope="session")
def gguf_llama(tmp_path_factory):
    """(the transformers model, {matrix type: path of its GGUF file}), each file in a folder of its own."""
    pytest.importorskip("gguf")
    model = tiny_llama(len(bpe_tokenizer()[0]))
    files = {}
    for kind in MATRIX_TYPES:
        folder = tmp_path_factory.mktemp(f"gguf-{kind}")
        files[kind] = write_gguf(folder / f"tiny-{kind}.gguf", model, kind)
    return model, files
