"""An untrusted model dir runs no code and pickle is refused.

A real tiny checkpoint is planted with traps, each of which writes a file into a marker
directory outside the model dir when it runs: Python modules named by ``auto_map``
(``modeling_evil.py``, ``configuration_evil.py``, ``tokenization_evil.py``) plus an
``__init__.py`` and a ``sitecustomize.py``, and a ``pytorch_model.bin`` written with
``torch.save`` whose unpickling calls ``exec``. ``test_traps_fire_when_run`` proves the
traps are live, so an empty marker dir elsewhere means no checkpoint code ran.

The loader's choice (``workers/loader.py``): ``auto_map`` in config.json is refused with a
ValueError; in tokenizer_config.json it is ignored when ``tokenizer_class`` is a class
transformers ships, refused otherwise; pickle-only weights are refused naming the file.
"""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

import pytest
import torch

from tests.reliability.conftest import wait_until
from workers.llm import LLM
from workers.sampling.params import SamplingParams

pytestmark = [pytest.mark.timeout(300)]
TRAP_MODULES = ("modeling_evil.py", "configuration_evil.py", "tokenization_evil.py", "__init__.py", "sitecustomize.py")
ENGINE = {"device": "cpu", "dtype": "float32", "cache": {"page_size": 4, "max_kv_tokens": 512}}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [11, 12, 13, 14, 15, 16, 17]


class _PickleTrap:
    """Unpickling this calls ``exec(code)`` (what a hostile ``pytorch_model.bin`` does)."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (self.code,)


def _writer(marker_dir: Path, name: str) -> str:
    return f"import pathlib\npathlib.Path({str(marker_dir / name)!r}).write_text('ran')\n"


def plant_traps(model_dir: Path, marker_dir: Path, *, pickle_name: str = "pytorch_model.bin") -> None:
    """Custom modules and a code-running pickle in ``model_dir``; each writes into ``marker_dir``."""
    classes = (
        "class EvilConfig: pass\nclass EvilModel: pass\nclass EvilTokenizer: pass\nclass EvilTokenizerFast: pass\n"
    )
    for name in TRAP_MODULES:
        (model_dir / name).write_text(_writer(marker_dir, name) + classes)
    torch.save({"lm_head.weight": _PickleTrap(_writer(marker_dir, pickle_name))}, model_dir / pickle_name)


def edit_json(path: Path, **fields: object) -> None:
    raw = json.loads(path.read_text())
    raw.update(fields)
    path.write_text(json.dumps(raw, indent=2))


def tokenizer_auto_map(model_dir: Path, tokenizer_class: str | None = None) -> None:
    fields: dict[str, object] = {
        "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", "tokenization_evil.EvilTokenizerFast"]}
    }
    if tokenizer_class is not None:
        fields["tokenizer_class"] = tokenizer_class
    edit_json(model_dir / "tokenizer_config.json", **fields)


def model_auto_map(model_dir: Path) -> None:
    edit_json(
        model_dir / "config.json",
        auto_map={"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"},
    )


@pytest.fixture(scope="module")
def marker_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("markers")


@pytest.fixture
def no_code_ran(marker_dir: Path):
    """Asserts after the test that no trap wrote its marker."""
    yield
    assert sorted(p.name for p in marker_dir.iterdir()) == []


def trapped_copy(src: Path, dst: Path, marker_dir: Path) -> Path:
    shutil.copytree(src, dst)
    plant_traps(dst, marker_dir)
    return dst


@pytest.fixture(scope="module")
def trapped_dir(tiny_qwen_dir, tmp_path_factory, marker_dir) -> Path:
    """Servable: every trap, pickle beside safetensors, tokenizer ``auto_map`` (built-in class)."""
    out = trapped_copy(Path(tiny_qwen_dir), tmp_path_factory.mktemp("trapped") / "m", marker_dir)
    tokenizer_auto_map(out)
    return out


@pytest.fixture(scope="module")
def clean_tokens(tiny_qwen_dir) -> list[int]:
    return LLM(model=str(tiny_qwen_dir), **ENGINE).generate_ids([PROMPT], [GREEDY])[0].token_ids


def test_traps_fire_when_run(tiny_granite_dir, tmp_path: Path) -> None:
    """The traps are live: importing a module or unpickling the .bin writes its marker."""
    markers = tmp_path / "markers"
    markers.mkdir()
    model_dir = trapped_copy(Path(tiny_granite_dir), tmp_path / "m", markers)
    for name in TRAP_MODULES:
        runpy.run_path(str(model_dir / name))
    with pytest.raises(Exception):  # torch's default safe loader refuses it
        torch.load(model_dir / "pytorch_model.bin")
    torch.load(model_dir / "pytorch_model.bin", weights_only=False)
    assert sorted(p.name for p in markers.iterdir()) == sorted([*TRAP_MODULES, "pytorch_model.bin"])


def test_engine_and_tokenizers_run_no_checkpoint_code(trapped_dir, tiny_qwen_dir, clean_tokens, no_code_ran) -> None:
    """Loads from safetensors (same greedy tokens as the clean dir); auto_map ignored."""
    from transformers import AutoTokenizer

    from workers.loader import load_tokenizer

    llm = LLM(model=str(trapped_dir), **ENGINE)
    assert llm.generate_ids([PROMPT], [GREEDY])[0].token_ids == clean_tokens
    text = "def f(x):\n    return x + 1\n"
    expected = AutoTokenizer.from_pretrained(str(tiny_qwen_dir)).encode(text)
    # the ingress's call (cluster/api/ingress.py), then ours: both from tokenizer.json only
    assert AutoTokenizer.from_pretrained(str(trapped_dir)).encode(text) == expected
    assert load_tokenizer(trapped_dir).encode(text) == expected
    assert llm.encode(text) == expected


def test_model_auto_map_is_refused(tiny_qwen_dir, tmp_path: Path, marker_dir: Path, no_code_ran) -> None:
    from transformers import AutoTokenizer

    model_dir = trapped_copy(Path(tiny_qwen_dir), tmp_path / "m", marker_dir)
    model_auto_map(model_dir)
    tokenizer_auto_map(model_dir)
    with pytest.raises(ValueError, match=r"config\.json has auto_map .*modeling_evil.*never runs"):
        LLM(model=str(model_dir), **ENGINE)
    AutoTokenizer.from_pretrained(str(model_dir))  # the ingress's call: no code, no prompt


def test_custom_tokenizer_class_is_refused(tiny_granite_dir, tmp_path: Path, marker_dir: Path, no_code_ran) -> None:
    from transformers import AutoTokenizer

    from workers.loader import load_tokenizer

    model_dir = trapped_copy(Path(tiny_granite_dir), tmp_path / "m", marker_dir)
    tokenizer_auto_map(model_dir, tokenizer_class="EvilTokenizerFast")
    with pytest.raises(ValueError, match=r"tokenizer_class 'EvilTokenizerFast'.*never runs"):
        load_tokenizer(model_dir)
    with pytest.raises(ValueError, match="EvilTokenizerFast"):
        LLM(model=str(model_dir), **ENGINE)
    AutoTokenizer.from_pretrained(str(model_dir))  # the ingress's call: no code, no prompt


@pytest.mark.parametrize("pickle_name", ["pytorch_model.bin", "model.pt"])
def test_pickle_only_dir_is_refused(
    tiny_granite_dir, tmp_path: Path, marker_dir: Path, pickle_name: str, no_code_ran
) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_granite_dir, model_dir, ignore=shutil.ignore_patterns("*.safetensors*"))
    plant_traps(model_dir, marker_dir, pickle_name=pickle_name)
    with pytest.raises(ValueError) as err:
        LLM(model=str(model_dir), **ENGINE)
    assert pickle_name in str(err.value) and "pickle is not loaded" in str(err.value)


def test_index_naming_a_pickle_shard_is_refused(
    tiny_granite_dir, tmp_path: Path, marker_dir: Path, no_code_ran
) -> None:
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_granite_dir, model_dir)
    plant_traps(model_dir, marker_dir)
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "pytorch_model.bin"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*pickle is never loaded"):
        LLM(model=str(model_dir), **ENGINE)


@pytest.mark.ray
def test_served_through_the_cluster(deployed, trapped_dir, clean_tokens, no_code_ran) -> None:
    """Ingress (tokenizer) and replica (model) load the trapped dir; output as the clean one."""
    import httpx

    app = deployed("untrusted", str(trapped_dir))
    body = {
        "model": app.name,
        "prompt": PROMPT,
        "max_tokens": GREEDY.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    with httpx.Client(base_url=app.base_url, timeout=120) as http:
        models = wait_until(lambda: http.get("/v1/models").json()["data"], timeout_s=60)
        body["model"] = models[0]["id"]
        got = http.post("/v1/completions", json=body)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["token_ids"] == clean_tokens
        chat = http.post(
            "/v1/chat/completions",
            json={"model": body["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert chat.status_code == 200, chat.text
        assert http.get("/health").status_code == 200
