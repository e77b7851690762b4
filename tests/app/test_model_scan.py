"""Finding GGUF files in model folders: first shards only, no duplicates through links."""

from __future__ import annotations

from app.models.model_scan import scan
from app.models.model_summary import human_bytes, human_count, summarize
from engine.gguf.hparams import HParams
from engine.gguf.reader import GGUFModel


def test_scan_lists_models_once(tmp_path):
    a = tmp_path / "hub" / "org" / "model"
    a.mkdir(parents=True)
    (a / "small.gguf").write_bytes(b"x" * 2048)
    (a / "big-00001-of-00002.gguf").write_bytes(b"x" * 2048)
    (a / "big-00002-of-00002.gguf").write_bytes(b"x" * 2048)
    (a / "empty.gguf").write_bytes(b"")  # a broken download
    (a / "notes.txt").write_text("hi")
    (tmp_path / "link.gguf").symlink_to(a / "small.gguf")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "secret.gguf").write_bytes(b"x" * 2048)
    names = sorted(p.name for p in scan([tmp_path]))
    assert names in (["big-00001-of-00002.gguf", "small.gguf"], ["big-00001-of-00002.gguf", "link.gguf"])
    assert len(list(scan([tmp_path], limit=1))) == 1


def test_summary_of_a_synthetic_model(synth_model):
    g = GGUFModel.open(synth_model("qwen2"))
    s = summarize(g, HParams.from_model(g))
    rows = dict(s.rows())
    assert rows["Architecture"] == "qwen2" and rows["Layers"] == "4"
    assert s.n_params == sum(t.n_elements for t in g.tensors)
    assert abs(sum(share for _, share in s.quant_mix) - 1.0) < 1e-9
    assert rows["File size"] == human_bytes(g.file_size)


def test_human_units():
    assert human_bytes(0) == "0 B" and human_bytes(1536) == "1.5 KiB"
    assert human_bytes(24 << 30) == "24 GiB" and human_bytes(150 << 20) == "150 MiB"
    assert human_bytes(-(3 << 20)) == "-3 MiB"
    assert human_count(630_000_000) == "630M" and human_count(7_240_000_000) == "7.24B"
