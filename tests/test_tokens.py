"""utils.tokens: the byte table, pieces back to bytes, prompts of exact length, chat prompts."""

from __future__ import annotations

import pytest
import torch

from utils.errors import EmptyPromptError, WorkbookError
from utils.tokens import bytes_to_unicode, chat_ids, encode, filler_ids, piece_bytes


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from utils.models import prepare_embedded

    return AutoTokenizer.from_pretrained(prepare_embedded(verbose=False))


def test_byte_table_is_a_bijection_onto_printable_characters():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in table.values())
    assert table[ord("A")] == "A" and table[0x20] == "Ġ"  # printable bytes stand for themselves


def test_piece_bytes_inverts_the_table():
    assert piece_bytes("Ġmarket") == b" market"
    assert piece_bytes("".join(bytes_to_unicode()[b] for b in "시".encode())) == "시".encode()
    assert piece_bytes("<|im_end|>") == b"<|im_end|>"  # ASCII is its own piece
    assert piece_bytes("\u4e00") is None  # not written in the byte alphabet


@pytest.mark.parametrize("text", ["Tokenizers read pieces.", "시장에 갔다", "x = 3.14159\n", " 2024-01-02"])
def test_pieces_put_together_are_the_text_bytes(tok, text):
    ids = tok(text, add_special_tokens=False).input_ids
    assert b"".join(piece_bytes(p) for p in tok.convert_ids_to_tokens(ids)) == text.encode("utf-8")


def test_filler_ids_has_exactly_n_tokens(tok):
    for n in (1, 7, 700):
        ids = filler_ids(tok, n)
        assert ids.shape == (1, n) and ids.dtype == torch.long
    assert torch.equal(filler_ids(tok, 700)[0, :7], filler_ids(tok, 7)[0])  # a prefix of the same prose
    with pytest.raises(WorkbookError):
        filler_ids(tok, 0)


def test_encode_and_chat_ids(tok):
    plain = encode(tok, "Why is the sky blue?")
    assert plain.shape[0] == 1 and tok.decode(plain[0]) == "Why is the sky blue?"
    chat = chat_ids(tok, "Why is the sky blue?")
    text = tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat[0].tolist() == tok(text, add_special_tokens=False).input_ids
    assert chat.shape[1] > plain.shape[1]  # the template costs tokens
    assert torch.equal(encode(tok, "Why is the sky blue?", chat=True), chat)


@pytest.mark.parametrize("bad", ["", "   \n"])
def test_empty_prompt_is_a_clear_error(tok, bad):
    with pytest.raises(EmptyPromptError):
        encode(tok, bad)
