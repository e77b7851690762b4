"""Presets, recent files and the last session round-trip through JSON files."""

from __future__ import annotations

import json

from app.models.presets import MAX_RECENT, PresetStore, config_dir, model_key


def test_config_dir_follows_the_environment(_config_dir):
    assert config_dir() == _config_dir


def test_preset_round_trip(tmp_path):
    store = PresetStore()
    settings = {"ctx": 8192, "kv_type": "q8_0", "split": [0, 10, 24], "arena": "chunked:256",
                "cache_reserve": 512 << 20, "prefill_chunk": 256, "excluded": [2]}
    store.save_preset("/models/a/qwen-q4.gguf", "long ctx", settings)
    store.save_preset("/models/a/qwen-q4.gguf", "short", {"ctx": 512})
    # a fresh store reads the same file; the same file name in another folder shares presets
    again = PresetStore()
    assert again.presets("/elsewhere/qwen-q4.gguf")["long ctx"] == settings
    assert sorted(again.presets("/models/a/qwen-q4.gguf")) == ["long ctx", "short"]
    again.delete_preset("/models/a/qwen-q4.gguf", "short")
    assert list(PresetStore().presets("/models/a/qwen-q4.gguf")) == ["long ctx"]
    assert PresetStore().presets("/models/other.gguf") == {}


def test_shards_share_a_key():
    assert model_key("/m/big-00001-of-00003.gguf") == model_key("/n/big-00002-of-00003.gguf")
    assert model_key("/m/we ird:name.gguf") == "we_ird_name.gguf"


def test_recent_files_most_recent_first_without_duplicates(tmp_path):
    store = PresetStore()
    files = []
    for i in range(MAX_RECENT + 3):
        f = tmp_path / f"m{i}.gguf"
        f.write_bytes(b"x")
        files.append(str(f.resolve()))
        store.add_recent(str(f))
    store.add_recent(files[5])
    recent = PresetStore().recent_files()
    assert recent[0] == files[5] and len(recent) == MAX_RECENT and len(set(recent)) == MAX_RECENT


def test_last_session_and_damaged_files(_config_dir):
    store = PresetStore()
    store.save_last_session("/m/x.gguf", "2x24GiB", {"ctx": 1024})
    assert PresetStore().last_session() == {"model": "/m/x.gguf", "rig": "2x24GiB",
                                            "settings": {"ctx": 1024}}
    (_config_dir / "last.json").write_text("{not json")
    (_config_dir / "recent.json").write_text(json.dumps({"not": "a list"}))
    assert store.last_session() == {} and store.recent_files() == []
    assert not list(_config_dir.glob("*.tmp"))  # writes go through a temp file and a rename
