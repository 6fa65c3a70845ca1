"""pd's values in a job's store are signed with the job's secret (`pdcli.runtime.signed`): what a
stranger who reaches the store writes (a listing naming its own stages, a file's bytes, a plan
digest, the results) is refused, and nothing it wrote reaches a node's run directory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from torch.distributed import HashStore

from pdcli import share
from pdcli.errors import UserError
from pdcli.rundir import RunDir, sha256_bytes
from pdcli.runtime import handshake
from pdcli.runtime.job import Job
from pdcli.runtime.launcher import Hosts
from pdcli.runtime.rendezvous import job_prefix
from pdcli.runtime.results import ResultsNotReceived, publish_results, receive_results
from pdcli.runtime.signed import MAC_BYTES, Forged, SignedStore

sys.path.insert(0, str(Path(__file__).parent))
from test_multihost import _fake_run, _files  # noqa: E402

SECRET = handshake.secret_key("the secret of these tests")


@pytest.fixture(autouse=True)
def job_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(handshake.SECRET_ENV, "the secret of these tests")


def test_a_value_reads_back_only_as_the_job_signed_it() -> None:
    raw = HashStore()
    store = SignedStore(raw, SECRET, "pd-job1")
    store.set("plan", "digest-a")
    store.set("bytes", b"\0\1\2")
    assert store.get("plan") == b"digest-a" and store.get("bytes") == b"\0\1\2"
    assert len(raw.get("plan")) == MAC_BYTES + len(b"digest-a")
    refusals = {
        "unsigned": lambda: raw.set("plan", "digest-b"),
        "moved from another key": lambda: raw.set("plan", raw.get("bytes")),
        "another job under the same secret": lambda: SignedStore(raw, SECRET, "pd-job2").set("plan", "digest-b"),
        "another secret": lambda: SignedStore(raw, handshake.secret_key("other"), "pd-job1").set("plan", "digest-b"),
        "shorter than a MAC": lambda: raw.set("plan", b"x"),
        "one bit flipped": lambda: raw.set("plan", bytes([raw.get("plan")[0] ^ 1]) + raw.get("plan")[1:]),
    }
    for how, forge in refusals.items():
        store.set("plan", "digest-a")
        forge()
        with pytest.raises(Forged, match="'plan' in the job's store is not signed with this job's secret"):
            store.get("plan")
        print(f"refused: {how}")
    with pytest.raises(ValueError, match="needs the job's secret"):
        SignedStore(raw, b"", "pd-job1")


def _job(store: HashStore, node_rank: int) -> Job:
    return Job(Hosts(nnodes=2, node_rank=node_rank, master_addr="n0", master_port=1), "pd-test", store)


def test_a_strangers_listing_and_bytes_never_reach_a_nodes_run_directory(tmp_path: Path) -> None:
    store = HashStore()
    node0, cfg = _fake_run(tmp_path / "node0")
    _job(store, 0).share(node0, cfg)
    received = RunDir(tmp_path / "node1")
    _job(store, 1).share(received, cfg)  # node 0's own, signed
    assert _files(received) == _files(node0)

    # a stranger rewrites the listing: its own stage file, with that file's true hash and size
    raw = job_prefix(store, "pd-test")
    listing = json.loads(SignedStore(raw, SECRET, "pd-test").get(share.LISTING_KEY))
    evil = b"import os; os.system('touch pwned')"
    stages = listing["artifacts"]["stages"]
    stages["files"]["stages/sub/stage_0.pt"], stages["sizes"]["stages/sub/stage_0.pt"] = sha256_bytes(evil), len(evil)
    stages["sha256"] = "forged"
    raw.set(share.LISTING_KEY, json.dumps(listing))
    raw.set("file/stages/sub/stage_0.pt#0", evil)
    fresh = RunDir(tmp_path / "node2")
    with pytest.raises(UserError, match=r"node 0's \(n0:1\) plan and stages: 'listing' in the job's store is not signed") as e:
        _job(store, 1).share(fresh, cfg)
    assert "same secret" in (e.value.hint or "")
    assert not (fresh / "stages").exists() and not (fresh / "plan.json").exists()

    # node 0's listing again, but one file's bytes replaced: refused before that artifact is written
    _job(store, 0).share(node0, cfg)
    raw.set("file/stages/sub/stage_0.pt#0", evil)
    with pytest.raises(UserError, match=r"'file/stages/sub/stage_0.pt#0' in the job's store is not signed"):
        _job(store, 1).share(RunDir(tmp_path / "node3"), cfg)
    assert not (tmp_path / "node3" / "stages").exists()


def test_a_node_with_another_secret_is_told_to_give_every_node_the_same(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    store = HashStore()
    node0, cfg = _fake_run(tmp_path / "node0")
    _job(store, 0).share(node0, cfg)
    monkeypatch.setenv(handshake.SECRET_ENV, "another secret")
    with pytest.raises(UserError, match="is not signed with this job's secret") as e:
        _job(store, 1).share(RunDir(tmp_path / "node1"), cfg)
    assert "--secret-file" in (e.value.hint or "")


def test_results_and_the_plan_digest_a_stranger_wrote_are_refused(tmp_path: Path) -> None:
    from pdcli.runtime.session import PLAN_KEY, check_same_plan

    theirs, mine = tmp_path / "theirs", tmp_path / "mine"
    theirs.mkdir()
    mine.mkdir()
    (theirs / "summary.json").write_text('{"final_loss": 1.0}')
    store = SignedStore(HashStore(), SECRET, "pd-test")
    assert publish_results(store, theirs, node=1) == []
    store.store.set("results/listing", json.dumps({"node": 1, "files": {"summary.json": {"bytes": 2, "sha256": sha256_bytes(b"{}")}}}))
    store.store.set("results/file/summary.json#0", b"{}")
    with pytest.raises(ResultsNotReceived, match="no listing of node 1's results .*not signed with this job's secret"):
        receive_results(store, mine, node=1, timeout_s=5)
    assert not (mine / "summary.json").exists()

    raw = HashStore()
    node0, _ = _fake_run(tmp_path / "node0")
    other, _ = _fake_run(tmp_path / "other")
    (other / "stages" / "sub" / "stage_0.pt").write_bytes(b"other weights")
    other.register("stages", "in-stages")
    from pdcli.rundir import hash_obj
    from pdcli.runtime.launch import read_plan

    record = other.record("stages")
    assert record is not None
    raw.set(PLAN_KEY, hash_obj({"plan": read_plan(other.path), "stages": record.sha256}))  # the stranger's digest
    with pytest.raises(Forged, match="'pd/job/plan' in the job's store is not signed"):
        check_same_plan(raw, other.path, rank=1)


def test_a_node_that_stops_before_training_stops_the_others_with_its_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 1 refuses what it was given: node 0, waiting for it before starting its workers,
    stops with node 1's message; a failure a stranger wrote is not believed; when every node
    arrives, the wait ends."""
    import threading

    from pdcli.runtime.job import ARRIVED_KEY, FAILED_KEY

    monkeypatch.setenv(handshake.SECRET_ENV, "the secret")
    store = HashStore()
    raw = job_prefix(store, "pd-test")
    raw.set(f"{FAILED_KEY}1", "a stranger says node 1 stopped")  # unsigned
    with pytest.raises(UserError, match=r"nodes \[1\] of the job did not get ready within 0.3 s"):
        _job(store, 0).wait_for_nodes(timeout_s=0.3)
    _job(store, 1).fail(UserError("node 0's plan and stages: 'listing' ... is not signed"))
    with pytest.raises(UserError, match="node 1 of the job stopped before training: node 0's plan and stages: 'listing'") as e:
        _job(store, 0).wait_for_nodes(timeout_s=30)
    assert "fix that on node 1" in (e.value.hint or "")

    store = HashStore()
    waiter = threading.Thread(target=_job(store, 1).wait_for_nodes, kwargs={"timeout_s": 30})
    waiter.start()
    _job(store, 0).wait_for_nodes(timeout_s=30)
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert SignedStore(job_prefix(store, "pd-test"), handshake.secret_key("the secret"), "pd-test").get(f"{ARRIVED_KEY}0") == b"1"
