"""Fixed data of the tiny tokenizer: its training text, special tokens and chat template.

The text lives here (not read from the Python installation) so every machine trains the
same merges. Changing it changes the tokenizer of every freshly generated tiny checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")

# ChatML, as Qwen models use it; renders with transformers' apply_chat_template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TRAINING_TEXT = '''\
The quick brown fox jumps over the lazy dog. A small model can still say hello to the world.
Once upon a time there was a little server that answered every request with care and speed.
It read the prompt, it thought for a while, and then it wrote the answer one token at a time.
Hello! How are you today? I am fine, thank you. What would you like to know about the sea?
The system is a helpful assistant. The user asks a question and the assistant replies.
Please write a short story about a cat, a dog and a bird who live together in a house.
Tell me a joke about computers. Why did the program stop? Because it reached the end.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 3.14 2.71 1e-6.
Days of the week are Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.
Colors of the rainbow: red, orange, yellow, green, blue, indigo and violet.
In the morning we drink coffee or tea, at noon we eat bread and soup, at night we sleep.
Memory, state, cache, prefix, token, layer, model, batch, request, response, stream.
Recurrent models keep a state; attention models keep keys and values for every position.

def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    result = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


if __name__ == "__main__":
    import sys
    print("hello, world", file=sys.stderr)
    for i, x in enumerate(fibonacci(10)):
        print(f"{i}: {x}")
    data = {"name": "tiny", "size": 64, "layers": [1, 2, 3], "ok": True, "none": None}
    try:
        value = data["missing"]
    except KeyError as exc:
        raise ValueError(f"bad key: {exc}") from None
    while True:
        break
    with open("out.txt", "w") as f:
        f.write("done\\n")
    lambda x: x * 2 if x > 0 else -x
    assert isinstance(data, dict) and len(data) == 5
    return_value = [y for y in range(100) if y % 3 == 0]

{"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "yes"}]}
<html><body><p>Simple is better than complex. Readability counts.</p></body></html>
SELECT name, count(*) FROM users WHERE age > 18 GROUP BY name ORDER BY name;
Errors should never pass silently. Unless explicitly silenced. Now is better than never.
Beautiful is better than ugly. Explicit is better than implicit. Flat is better than nested.
'''


def write_tokenizer_config(out_dir: Path) -> None:
    """The ``tokenizer_config.json`` of our byte-level BPE tokenizers (tiny and trained):
    ``EOS_TOKEN`` is eos and pad, the other specials are additional, ChatML template."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != EOS_TOKEN],
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
