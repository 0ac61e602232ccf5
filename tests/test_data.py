"""Tests of trio_helpers.data: loaders (offline, local folders, fake downloads) and annotation helpers.

Nothing here touches the network: the probe and the downloader are replaced where a real one would run.
"""

from __future__ import annotations

import json
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trio_helpers import data
from trio_helpers.offline import corpus


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test loudly."""
    def refuse(*args, **kwargs):
        raise AssertionError("a test tried to use the network")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture
def online_env(monkeypatch, tmp_path):
    """As on a user's machine: no TRIO_BACKEND, no HF offline flag, an empty working directory."""
    monkeypatch.delenv("TRIO_BACKEND", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)


def shipped(name: str) -> list[dict]:
    return [json.loads(line) for line in (data.OFFLINE_DIR / name).read_text().splitlines()]


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


ROWS = [{"question": f"Q{i}?", "answer": f"A is {i}+1 = <<{i}+1={i + 1}>>{i + 1}.\n#### {i + 1}"} for i in range(5)]


# --- GSM8K ---------------------------------------------------------------------------------------


def test_offline_gsm8k_shape_and_order(no_network, capsys):
    train = data.load_gsm8k("train", source="offline")
    test = data.load_gsm8k("test", source="offline")
    assert train == shipped("gsm8k_train.jsonl") and len(train) == 600
    assert test == shipped("gsm8k_test.jsonl") and len(test) == 300
    assert all(set(r) == {"question", "answer"} and r["answer"].split("\n")[-1].startswith("#### ") for r in train)
    assert "source=offline" in capsys.readouterr().out


def test_auto_uses_offline_when_trio_backend_is_offline(monkeypatch, no_network, capsys, tmp_path):
    monkeypatch.setenv("TRIO_BACKEND", "offline")
    (tmp_path / "gsm8k").mkdir()  # even a local folder does not override the offline backend
    monkeypatch.chdir(tmp_path)
    assert data.load_gsm8k() == shipped("gsm8k_train.jsonl")
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "source=offline" in out and "TRIO_BACKEND=offline" in out


def test_auto_falls_back_to_offline_without_network(online_env, monkeypatch, capsys):
    probed = []
    monkeypatch.setattr(data, "_reachable", lambda host, *a, **k: probed.append(host) or False)
    assert data.load_gsm8k("test") == shipped("gsm8k_test.jsonl")
    assert probed == ["huggingface.co"]
    assert "unreachable" in capsys.readouterr().out


def test_auto_falls_back_to_offline_when_the_hub_fails(online_env, monkeypatch, capsys):
    monkeypatch.setattr(data, "_reachable", lambda *a, **k: True)

    def broken_hub(split):
        raise OSError("cache miss")

    monkeypatch.setattr(data, "_load_gsm8k_hf", broken_hub)
    assert len(data.load_gsm8k("test")) == 300
    assert "Hugging Face failed with OSError" in capsys.readouterr().out


def test_hf_source_fails_fast_when_unreachable(online_env, monkeypatch):
    monkeypatch.setattr(data, "_reachable", lambda *a, **k: False)
    with pytest.raises(ConnectionError, match="source='local'"):
        data.load_gsm8k("train", source="hf")


def test_probe_honours_hf_endpoint_mirror(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "https://hf-mirror.example.org")
    assert data._hf_host() == "hf-mirror.example.org"
    monkeypatch.delenv("HF_ENDPOINT")
    assert data._hf_host() == "huggingface.co"


def test_probe_returns_false_instead_of_raising(monkeypatch):
    def fail(*args, **kwargs):
        raise socket.timeout("timed out")

    monkeypatch.setattr(socket, "create_connection", fail)
    assert data._reachable("huggingface.co") is False


def test_local_parquet_folder_like_modelscope(tmp_path, no_network, capsys):
    root = tmp_path / "gsm8k"
    write_parquet(root / "main" / "train-00000-of-00001.parquet", ROWS[:3])
    write_parquet(root / "main" / "test-00000-of-00001.parquet", ROWS[3:])
    write_parquet(root / "socratic" / "train-00000-of-00001.parquet", [{"question": "S", "answer": "#### 0"}])
    assert data.load_gsm8k("train", source="local", path=str(root)) == ROWS[:3]
    assert data.load_gsm8k("test", source="modelscope", path=str(root)) == ROWS[3:]
    assert "source=local" in capsys.readouterr().out


def test_auto_prefers_a_local_folder(online_env, tmp_path, no_network, capsys):
    write_parquet(tmp_path / "gsm8k" / "main" / "train-00000-of-00001.parquet", ROWS)
    assert data.load_gsm8k("train") == ROWS  # finds ./gsm8k in the working directory
    assert "found folder gsm8k" in capsys.readouterr().out


def test_local_jsonl_folder(tmp_path, no_network):
    root = tmp_path / "grade_school_math" / "data"
    root.mkdir(parents=True)
    rows = [dict(r, extra="dropped") for r in ROWS]
    (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert data.load_gsm8k("test", source="local", path=str(tmp_path)) == ROWS


def test_missing_local_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="modelscope download"):
        data.load_gsm8k("train", source="local", path=str(tmp_path / "nowhere"))


def test_gsm8k_validation():
    with pytest.raises(ValueError, match=r"split must be one of 'train', 'test'; got 'validation'"):
        data.load_gsm8k("validation")
    with pytest.raises(ValueError, match=r"source must be one of .*'offline'.*got 's3'"):
        data.load_gsm8k("train", source="s3")


def test_calculator_annotations_and_steps():
    answer = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
              "She sold 48+24 = <<48+24=72>>72 clips altogether.\n"
              "That is a lot of clips.\n"
              "#### 72")
    assert data.calculator_annotations(answer) == [("48/2", "24"), ("48+24", "72")]
    assert data.calculator_annotations("<<2*3+1=7>>7") == [("2*3+1", "7")]
    assert data.count_steps(answer) == 3
    assert data.count_steps("") == 0
    for rec in shipped("gsm8k_train.jsonl"):
        assert data.count_steps(rec["answer"]) == len(data.calculator_annotations(rec["answer"]))
    with pytest.raises(TypeError):
        data.calculator_annotations(None)


# --- DeepMath ------------------------------------------------------------------------------------


class FakeDownloader:
    """Writes a small parquet shard (with an extra column) and records what it was asked for."""

    def __init__(self, rows_per_shard: int = 4):
        self.calls: list[tuple[str, str]] = []
        self.rows_per_shard = rows_per_shard

    def __call__(self, remote_path, dest):
        assert dest.name.endswith(".tmp") and not dest.exists()
        self.calls.append((remote_path, dest.name))
        shard = int(remote_path.split("-")[1])
        rows = [{"question": f"shard {shard} problem {i}", "final_answer": str(i), "difficulty": 5.0 + i,
                 "r1_solution_1": "long text"} for i in range(self.rows_per_shard)]
        write_parquet(dest, rows)


def test_offline_deepmath(no_network, monkeypatch, capsys):
    monkeypatch.setenv("TRIO_BACKEND", "offline")
    everything = shipped("deepmath.jsonl")
    sample = data.load_deepmath(sample_size=5, seed=1)
    assert len(sample) == 5 and all(r in everything for r in sample)
    assert sample == data.load_deepmath(sample_size=5, seed=1)
    assert sample != data.load_deepmath(sample_size=5, seed=2)
    assert len(data.load_deepmath(source="offline", sample_size=0)) == len(everything) == 300
    assert "source=offline" in capsys.readouterr().out


def test_shard_download_names_skip_and_rename(tmp_path):
    fake = FakeDownloader()
    paths = data.download_deepmath_shards(2, tmp_path, downloader=fake)
    assert [p.relative_to(tmp_path).as_posix() for p in paths] == [
        "data/train-00000-of-00010.parquet", "data/train-00001-of-00010.parquet"]
    assert fake.calls == [("data/train-00000-of-00010.parquet", "train-00000-of-00010.parquet.tmp"),
                          ("data/train-00001-of-00010.parquet", "train-00001-of-00010.parquet.tmp")]
    assert all(p.is_file() for p in paths) and not list(tmp_path.rglob("*.tmp"))
    data.download_deepmath_shards(3, tmp_path, downloader=fake)  # only the third shard is new
    assert [c[0] for c in fake.calls[2:]] == ["data/train-00002-of-00010.parquet"]


def test_failed_download_leaves_nothing_behind(tmp_path):
    def half_then_fail(remote_path, dest):
        dest.write_bytes(b"PAR1 truncated")
        raise ConnectionError("lost the connection")

    with pytest.raises(ConnectionError):
        data.download_deepmath_shards(1, tmp_path, downloader=half_then_fail)
    assert not list(tmp_path.rglob("*.parquet*"))
    with pytest.raises(RuntimeError, match="did not write"):
        data.download_deepmath_shards(1, tmp_path, downloader=lambda remote, dest: None)


@pytest.mark.parametrize("bad", [0, 11, -1, True, "2", 2.0])
def test_num_shards_validation(tmp_path, bad):
    with pytest.raises(ValueError, match="num_shards must be an int from 1 to 10"):
        data.download_deepmath_shards(bad, tmp_path, downloader=FakeDownloader())
    with pytest.raises(ValueError, match="num_shards"):
        data.load_deepmath(source="offline", num_shards=bad)


def test_deepmath_other_validation(tmp_path):
    with pytest.raises(ValueError, match="source must be one of"):
        data.load_deepmath(source="hf")
    with pytest.raises(ValueError, match="sample_size must be an int"):
        data.load_deepmath(source="offline", sample_size=None)
    with pytest.raises(FileNotFoundError, match="source='modelscope'"):
        data.load_deepmath(source="local", local_dir=tmp_path)


def test_deepmath_from_fake_modelscope(tmp_path, no_network, monkeypatch, capsys):
    monkeypatch.delenv("TRIO_BACKEND", raising=False)
    fake = FakeDownloader(rows_per_shard=4)
    rows = data.load_deepmath(source="modelscope", sample_size=0, seed=3, num_shards=2,
                              local_dir=tmp_path, downloader=fake)
    assert len(fake.calls) == 2 and len(rows) == 8
    assert all(set(r) == {"question", "final_answer", "difficulty", "r1_solution_1"} for r in rows)
    assert {r["question"] for r in rows} == {f"shard {s} problem {i}" for s in (0, 1) for i in range(4)}
    again = data.load_deepmath(source="auto", sample_size=5, seed=3, num_shards=2, local_dir=tmp_path)
    assert len(fake.calls) == 2 and len(again) == 5  # auto found the shards; nothing downloaded
    assert again == data.load_deepmath(source="local", sample_size=5, seed=3, num_shards=2, local_dir=tmp_path)
    assert "found 2 shard(s)" in capsys.readouterr().out


def test_offline_corpus_is_what_the_generator_writes():
    assert data.load_gsm8k("train", source="offline")[:3] == corpus.generate_gsm8k(900, corpus.GSM8K_SEED)[:3]
