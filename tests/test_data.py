"""Tests of trio_helpers.data: loaders (offline, local folders, fake downloads), data following the backend,
broken shards, and annotation helpers.

Nothing here touches the network: the probe and the downloader are replaced where a real one would run. "The real
service is in use" is simulated by setting the backend module's record of the last connect(); no key is set.
"""

from __future__ import annotations

import json
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trio_helpers import backend, data
from trio_helpers.offline import corpus


@pytest.fixture(autouse=True)
def before_any_connect(monkeypatch):
    """Each test starts as a fresh process would: no connect() yet (restored afterwards)."""
    monkeypatch.setattr(backend, "_ACTIVE", None)


@pytest.fixture
def real_service(monkeypatch):
    """As after connect() returned the real service (nothing is contacted)."""
    monkeypatch.setattr(backend, "_ACTIVE", "remote")


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
    assert out.count("\n") == 1 and "source=offline" in out and "(offline backend)" in out


def test_data_follows_auto_backend_not_folders_or_network(online_env, monkeypatch, no_network, capsys, tmp_path):
    """No TRIO_BACKEND, no credential, a real ./gsm8k folder and a reachable Hub: connect() would pick the offline
    backend, so the data must be the offline corpus too (the silent mix this module used to allow)."""
    monkeypatch.setattr(backend, "has_pytrio_credentials", lambda: False)
    monkeypatch.setattr(data, "_reachable", lambda *a, **k: pytest.fail("probed the network"))
    write_parquet(tmp_path / "gsm8k" / "main" / "train-00000-of-00001.parquet", ROWS)
    assert data.load_gsm8k("train") == shipped("gsm8k_train.jsonl")
    assert data.load_deepmath(sample_size=3) == data.load_deepmath(source="offline", sample_size=3)
    assert "(offline backend)" in capsys.readouterr().out


def test_data_follows_the_backend_connect_returned(online_env, monkeypatch, no_network, capsys, tmp_path):
    monkeypatch.setenv("TRIO_BACKEND", "remote")  # the environment says remote ...
    import trio_helpers

    trio_helpers.connect("offline", latency=0.0, in_process=True)  # ... but the service in use is offline
    write_parquet(tmp_path / "gsm8k" / "main" / "train-00000-of-00001.parquet", ROWS)
    assert data.load_gsm8k("train") == shipped("gsm8k_train.jsonl")


def test_real_service_reads_a_local_folder(online_env, real_service, tmp_path, no_network, capsys):
    write_parquet(tmp_path / "gsm8k" / "main" / "train-00000-of-00001.parquet", ROWS)
    assert data.load_gsm8k("train") == ROWS  # finds ./gsm8k in the working directory
    assert "(real service; found folder gsm8k)" in capsys.readouterr().out


def test_real_service_never_falls_back_to_offline_data(online_env, real_service, monkeypatch):
    probed = []
    monkeypatch.setattr(data, "_reachable", lambda host, *a, **k: probed.append(host) or False)
    with pytest.raises(ConnectionError) as info:
        data.load_gsm8k("test")
    assert probed == ["huggingface.co"]
    assert "\n" not in str(info.value) and "modelscope download" in str(info.value)


def test_real_service_reports_a_failing_hub_in_one_line(online_env, real_service, monkeypatch):
    monkeypatch.setattr(data, "_reachable", lambda *a, **k: True)

    def broken_hub(split):
        raise OSError("cache miss\nsecond line of a long message")

    monkeypatch.setattr(data, "_load_gsm8k_hf", broken_hub)
    with pytest.raises(ConnectionError, match="OSError: cache miss") as info:
        data.load_gsm8k("test")
    assert "\n" not in str(info.value)


def test_explicit_source_against_the_backend_warns_in_one_line(monkeypatch, tmp_path, no_network, capsys):
    monkeypatch.setenv("TRIO_BACKEND", "offline")
    write_parquet(tmp_path / "gsm8k" / "main" / "test-00000-of-00001.parquet", ROWS)
    assert data.load_gsm8k("test", source="local", path=str(tmp_path / "gsm8k")) == ROWS  # loaded, but ...
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "source='local'" in err and "offline" in err and "source='offline'" in err
    monkeypatch.setattr(backend, "_ACTIVE", "remote")
    data.load_gsm8k("test", source="offline")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "real service" in err and "source='auto'" in err
    monkeypatch.setattr(backend, "_ACTIVE", "offline")
    data.load_gsm8k("test", source="offline")
    assert capsys.readouterr().err == ""  # agreeing sources are silent


def test_bad_trio_backend_stops_the_auto_loader(monkeypatch):
    monkeypatch.setenv("TRIO_BACKEND", "cloud")
    with pytest.raises(ValueError, match="offline, remote, auto"):
        data.load_gsm8k("train")
    assert len(data.load_gsm8k("train", source="offline")) == 600  # an explicit source does not need it


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


def test_deepmath_from_fake_modelscope(tmp_path, no_network, real_service, monkeypatch, capsys):
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


def test_deepmath_real_service_without_shards_or_network(tmp_path, real_service, monkeypatch):
    monkeypatch.setattr(data, "_reachable", lambda *a, **k: False)
    with pytest.raises(ConnectionError, match="source='local'"):
        data.load_deepmath(local_dir=tmp_path)


def truncate(path, keep=0.5):
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * keep)])


def test_truncated_shard_is_downloaded_again(tmp_path, no_network, real_service, capsys):
    fake = FakeDownloader()
    data.download_deepmath_shards(2, tmp_path, downloader=fake)
    shard = tmp_path / data.deepmath_shard_name(1)
    truncate(shard)  # e.g. copied while a download was still running
    rows = data.load_deepmath(source="modelscope", sample_size=0, num_shards=2, local_dir=tmp_path,
                              downloader=fake)
    assert len(rows) == 8 and [c[0] for c in fake.calls[2:]] == [data.deepmath_shard_name(1)]
    out = capsys.readouterr().out
    assert f"{shard} is truncated or corrupt" in out and "downloading it again" in out


def test_truncated_local_shard_is_named_with_the_fix(tmp_path, no_network):
    data.download_deepmath_shards(1, tmp_path, downloader=FakeDownloader())
    shard = tmp_path / data.deepmath_shard_name(0)
    truncate(shard, keep=0.3)
    with pytest.raises(ValueError) as info:
        data.load_deepmath(source="local", local_dir=tmp_path)
    message = str(info.value)
    assert "\n" not in message and str(shard) in message and "source='modelscope'" in message
    shard.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        data.load_deepmath(source="local", local_dir=tmp_path)


def test_shard_that_stays_broken_after_a_new_download(tmp_path, no_network):
    def broken(remote_path, dest):
        dest.write_bytes(b"PAR1 still broken")

    (tmp_path / "data").mkdir()
    (tmp_path / data.deepmath_shard_name(0)).write_bytes(b"PAR1 broken")
    with pytest.raises(ValueError, match="still unreadable after a fresh download"):
        data.load_deepmath(source="modelscope", local_dir=tmp_path, downloader=broken)


def test_offline_corpus_is_what_the_generator_writes():
    assert data.load_gsm8k("train", source="offline")[:3] == corpus.generate_gsm8k(900, corpus.GSM8K_SEED)[:3]
