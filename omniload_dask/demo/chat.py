"""Demo conversations for the SFT plan (plans/sft.yaml), from a fixed seed.

``make_chat_demo_data(folder)`` writes::

    chat/chat-0000.jsonl      conversations in the OpenAI ``messages`` layout (system, then
                              user/assistant turns of realistic, heavy-tailed lengths)
    qa/qa-0000.parquet        prompt/completion pairs of strings

The plan renders them with ChatML (given in the plan) over the byte tokenizer, and mixes in
the demo's plain web text.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omniload_dask.demo.vocabulary import VOCAB_SEED, demo_text, vocabulary

__all__ = ["CHATML_GENERATION", "make_chat_demo_data"]

# ChatML with its assistant turns in generation blocks (as TRL's assistant-only loss wants)
CHATML_GENERATION = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MARKER = ".omniload-chat-demo-complete"


def _turn(rng: np.random.Generator, vocab: list[str], mean: float) -> str:
    return demo_text(rng, vocab, int(np.clip(rng.lognormal(mean, 0.7), 2, 400)))


def make_chat_demo_data(folder: str | Path, scale: float = 1.0) -> Path:
    """Write the chat demo sources into ``folder`` (skipped if already complete)."""
    folder = Path(folder)
    if (folder / MARKER).exists():
        return folder
    rng = np.random.default_rng(VOCAB_SEED + 1)
    vocab = vocabulary(np.random.default_rng(VOCAB_SEED))
    (folder / "chat").mkdir(parents=True, exist_ok=True)
    (folder / "qa").mkdir(parents=True, exist_ok=True)
    lines = []
    for _ in range(int(1500 * scale)):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": _turn(rng, vocab, 2.0)})
        for _ in range(int(rng.integers(1, 4))):
            messages.append({"role": "user", "content": _turn(rng, vocab, 2.8)})
            messages.append({"role": "assistant", "content": _turn(rng, vocab, 3.6)})
        lines.append(json.dumps({"messages": messages}))
    (folder / "chat" / "chat-0000.jsonl").write_text("\n".join(lines) + "\n")
    n = int(1000 * scale)
    prompts = [_turn(rng, vocab, 2.6) + " ?" for _ in range(n)]
    completions = [" " + _turn(rng, vocab, 3.2) for _ in range(n)]
    table = pa.table({"prompt": prompts, "completion": completions})
    pq.write_table(table, folder / "qa" / "qa-0000.parquet", row_group_size=128)
    (folder / MARKER).write_text("ok\n")
    return folder
