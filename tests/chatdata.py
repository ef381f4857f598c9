"""Conversations and a chat tokenizer for the chat tests, made on the spot from fixed seeds.

The tokenizer is a byte-level BPE trained by Hugging Face ``tokenizers`` on the conversations'
words, with ChatML's special tokens, written as ``tokenizer.json`` and a
``tokenizer_config.json`` holding the chat template, as a model repository holds them; both
``transformers`` and the loader read that folder.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS_TEXT = (
    "the a of to and in is it that for on with as was be this are by at from or an but not "
    "what all were when we there can which their if do will each about how up out them then "
    "she many some so these would other into has more her two like him see time could no make "
    "than first been its who now people my made over did down only way find use may water long "
    "little very after words called just where most know get through back much before go good "
    "new write our used me man too any day same right look think also around another came come "
    "work three word must because does part even place well such here take why things help put "
    "years different away again off went old number great tell men say small every found still "
    "between name should home big give air line set own under read last never us left end "
    "along while might next sound below saw something thought both few those always looked show "
    "large often together asked house world going want school important until form food keep "
    "children feet land side without boy once animals life enough took sometimes four head "
    "above kind began almost live page got earth need far hand high year mother light parts "
    "country father let night following picture being study second eyes soon times story boys "
    "since white days ever paper hard near sentence better best across during today others "
    "however sure means knew its try told young miles sun ways thing whole hear example heard "
    "several change answer room sea against top turned learn point city play toward five using "
    "himself usually café naïve 東京 données"
)
WORDS = WORDS_TEXT.split(" ")


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    """Words joined by spaces, ``lo`` to ``hi`` of them, with some punctuation."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words) + rng.choice([".", "?", "!", "", ":\n- x"])


def conversation(rng: random.Random, turns: int | None = None) -> list[dict[str, str]]:
    """A conversation: maybe a system turn, then user/assistant pairs."""
    out = []
    if rng.random() < 0.3:
        out.append({"role": "system", "content": sentence(rng, 3, 12)})
    for _ in range(turns or rng.randint(1, 3)):
        out.append({"role": "user", "content": sentence(rng, 2, 30)})
        out.append({"role": "assistant", "content": sentence(rng, 1, 60)})
    return out


def conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` conversations from ``seed``."""
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(n)]


def write_chat_tokenizer(folder: Path, template: str = CHATML) -> Path:
    """A byte-level BPE tokenizer folder (tokenizer.json + tokenizer_config.json with
    ``template``); returns the tokenizer.json path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rng = random.Random(7)
    corpus = [sentence(rng, 5, 40) for _ in range(400)] + ["user assistant system"] * 20
    tok.train_from_iterator(corpus, trainer)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": template,
        "model_max_length": 1 << 20,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return path
