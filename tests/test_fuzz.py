"""Hostile input, generated (hypothesis): the handshake's framing, the stage messages' framing,
the config loader, the profile loader, `pd plan diff` on any two files, the run directory's
manifest.json and a checkpoint's files each end in their own clear refusal (or a correct
answer), never another exception, a hang, or an allocation a header merely announces. Every
suite is bounded (`max_examples`), a few seconds each."""

from __future__ import annotations

import copy
import os
import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from pdcli.errors import UserError  # noqa: E402
from pdcli.runtime import handshake, sockets  # noqa: E402
from pdcli.runtime.comm import message_tag  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # twelve suites of 60 inputs each: CI runs them (PD_FUZZ_EXAMPLES=N for more, random)
SECRET = bytes(range(32))
TIMEOUT_S = 5.0
BOUNDED = settings(max_examples=int(os.environ.get("PD_FUZZ_EXAMPLES", "60")), deadline=None, derandomize=os.environ.get("PD_FUZZ_EXAMPLES") is None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.settimeout(TIMEOUT_S)
    b.settimeout(TIMEOUT_S)
    return a, b


# -- the handshake -------------------------------------------------------------------------

hello_shaped = st.builds(lambda rank, nonce, proof: handshake.HELLO.pack(rank, nonce, proof),
                         st.integers(0, 2**64 - 1), st.binary(min_size=16, max_size=16),
                         st.binary(min_size=32, max_size=32))


@BOUNDED
@given(junk=st.one_of(st.binary(max_size=200), hello_shaped))
def test_a_listener_refuses_whatever_a_stranger_answers_its_challenge(junk: bytes) -> None:
    listener, stranger = pair()
    try:
        stranger.sendall(junk)
        stranger.shutdown(socket.SHUT_WR)
        with pytest.raises(handshake.Refused):
            handshake.check_connector(listener, SECRET, 0, {1, 2})
    finally:
        listener.close()
        stranger.close()


challenge_shaped = st.builds(lambda nonce, rest: handshake.MAGIC + nonce + rest,
                             st.binary(min_size=16, max_size=16), st.binary(max_size=64))


@BOUNDED
@given(junk=st.one_of(st.binary(max_size=200), challenge_shaped))
def test_a_connector_refuses_whatever_a_stranger_listening_at_the_address_says(junk: bytes) -> None:
    connector, stranger = pair()
    try:
        stranger.sendall(junk)
        stranger.shutdown(socket.SHUT_WR)
        with pytest.raises(handshake.Refused):
            handshake.prove_to_listener(connector, SECRET, 1, 0)
    finally:
        connector.close()
        stranger.close()


def test_a_recorded_hello_does_not_pass_a_new_challenge() -> None:
    """A stranger who saw one real handshake replays its hello to a new challenge: refused."""
    listener, connector = pair()
    try:
        import threading

        rank: list[int] = []
        t = threading.Thread(target=lambda: rank.append(handshake.check_connector(listener, SECRET, 0, {1})))
        t.start()
        handshake.prove_to_listener(connector, SECRET, 1, 0)
        t.join(TIMEOUT_S)
        assert rank == [1]
    finally:
        listener.close()
        connector.close()
    # the hello a real connector sends to a fixed challenge, recorded
    first = handshake.HELLO.pack(1, b"n" * 16, handshake._mac(SECRET, b"hello", b"c" * 16, 1, 0))
    listener, stranger = pair()
    try:
        stranger.sendall(first)
        with pytest.raises(handshake.Refused, match="without this job's proof"):
            handshake.check_connector(listener, SECRET, 0, {1})  # its challenge is a new nonce
    finally:
        listener.close()
        stranger.close()


# -- the stage messages' framing -----------------------------------------------------------

EXPECTED = 64
"""The one activation size the receiving rank's manifest allows from this peer."""

framed = st.lists(st.tuples(st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([message_tag("activation", k) for k in range(4)])),
                            st.one_of(st.integers(0, 2**64 - 1), st.just(EXPECTED)),
                            st.binary(max_size=2 * EXPECTED)), max_size=5)


@BOUNDED
@given(messages=framed, tail=st.binary(max_size=40))
def test_a_peer_never_allocates_what_a_header_announces_and_ends_with_a_named_error(
        messages: list[tuple[int, int, bytes]], tail: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    allocated: list[int] = []
    real = sockets._payload
    monkeypatch.setattr(sockets, "_payload", lambda n: allocated.append(n) or real(n))
    mine, stranger = pair()
    peer = sockets._Peer(1, mine, {"activation": EXPECTED})
    try:
        stream = b"".join(sockets.HEADER.pack(tag, nbytes) + body for tag, nbytes, body in messages) + tail
        try:
            stranger.sendall(stream)
        except OSError:
            pass  # the reader refused and shut its side: the rest of the stream is not read
        stranger.shutdown(socket.SHUT_WR)
        peer.thread.join(TIMEOUT_S)
        assert not peer.thread.is_alive(), "the reader hung on a stream that ended"
        assert peer.error is not None  # refused by name, or the stream's end
        assert set(allocated) <= {EXPECTED}
        assert all(t.numel() == EXPECTED for t in peer.inbox.values())
    finally:
        peer.outbox.put(None)
        peer.writer.join(TIMEOUT_S)
        mine.close()
        stranger.close()


# -- the config loader ---------------------------------------------------------------------

KEYS = ["plan.num_stages", "schedule.name", "schedule.num_microbatches", "data.batch_size", "train.steps",
        "cluster.levels", "model.kwargs.hidden", "optim.lr", "profile.repeats", "train.precision", "plan.boundaries",
        "run.name", "nosuch.key", "plan", "+plan.extra", "~train"]
VALUES = st.one_of(st.sampled_from(["0", "-1", "1e400", "nan", "null", "[]", "{}", "[1,", "${oops}", "'", "true",
                                    "[{devices: x}]", "999999999999999999999"]), st.text(max_size=12))


@BOUNDED
@given(overrides=st.lists(st.one_of(st.builds(lambda k, v: f"{k}={v}", st.sampled_from(KEYS), VALUES),
                                    st.text(max_size=20)), max_size=4))
def test_random_overrides_load_or_are_refused_as_a_config_error(overrides: list[str]) -> None:
    from pdcli.config.loader import load_config

    try:
        load_config(REPO / "recipes" / "quickstart.yaml", overrides)
    except UserError:
        pass


yaml_text = st.one_of(st.text(max_size=200),
                      st.builds(lambda k, v: f"{k.replace('.', ': {')}: {v}" + "}" * k.count("."),
                                st.sampled_from(KEYS), VALUES))


@BOUNDED
@given(text=yaml_text)
def test_a_random_recipe_loads_or_is_refused_as_a_config_error(text: str, tmp_path: Path) -> None:
    from pdcli.config.loader import load_config

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    try:
        load_config(recipe, [])
    except UserError:
        pass


# -- the profile loader --------------------------------------------------------------------

def json_values() -> st.SearchStrategy[Any]:
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=8))
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                        max_leaves=6)


@pytest.fixture(scope="module")
def real_profile() -> dict[str, Any]:
    from torch import nn

    from pdcli.profiler.measure import profile_model
    from types import SimpleNamespace

    torch.manual_seed(0)
    batch = SimpleNamespace(inputs=(torch.randn(4, 8),), target=torch.randint(0, 3, (4,)))
    chain = profile_model(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)), batch,
                          nn.functional.cross_entropy, "cpu", 0, 1, False)
    return chain.to_json()


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            out += _paths(v, (*prefix, i))
    return out


@BOUNDED
@given(data=st.data())
def test_a_profile_edited_at_random_loads_or_is_refused_naming_the_file(
        data: st.DataObject, real_profile: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> None:
    """A profile.json changed at one place (a value of another type, a key dropped), registered as
    if pd wrote it: `load_profile` gives a chain or a UserError naming the file."""
    from pdcli.rundir import RunDir
    from pdcli.steps.profile import load_profile

    run = RunDir(tmp_path_factory.mktemp("run")).create()
    run.write_json("profile.json", _edited(real_profile, data), "h")
    try:
        load_profile(run)
    except UserError as e:
        assert "profile.json" in str(e)


@BOUNDED
@given(cut=st.integers(0, 10_000), flip=st.integers(0, 10_000))
def test_a_profile_truncated_or_changed_on_disk_is_refused(cut: int, flip: int, real_profile: dict[str, Any],
                                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    from pdcli.rundir import RunDir
    from pdcli.steps.profile import load_profile

    run = RunDir(tmp_path_factory.mktemp("run")).create()
    run.write_json("profile.json", real_profile, "h")
    raw = bytearray((run / "profile.json").read_bytes())
    changed = raw[:cut % len(raw)] if cut % 2 else raw
    if not cut % 2:
        changed[flip % len(raw)] ^= 0x01
    (run / "profile.json").write_bytes(bytes(changed))
    with pytest.raises(UserError, match="profile.json"):
        load_profile(run)


def _edited(obj: Any, data: st.DataObject) -> Any:
    """`obj` (JSON) changed at one place drawn from `data`: a value of another type, or a key dropped."""
    obj = copy.deepcopy(obj)
    path = data.draw(st.sampled_from(_paths(obj)[1:]))
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    if data.draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(json_values())
    return json.loads(json.dumps(obj))


def _damaged(raw: bytes, cut: int, flip: int) -> bytes:
    """`raw` cut short (odd `cut`) or with one bit flipped (even `cut`)."""
    if cut % 2:
        return raw[:cut % len(raw)]
    changed = bytearray(raw)
    changed[flip % len(raw)] ^= 0x01
    return bytes(changed)


# -- plan.json (`pd plan diff` takes any two files) ------------------------------------------

@pytest.fixture(scope="module")
def real_plan() -> dict[str, Any]:
    from pdcli.planner import PlanOptions, Topology, plan_chain
    from pdcli.profiler.chain import Chain, ChainNode

    nodes = tuple(ChainNode(f"n{i}", f"layer{i}", 1.0 + i, 2.0, 1000, 100) for i in range(6))
    chain = Chain(nodes=nodes, cut_bytes=(10,) * 5)
    return plan_chain(chain, Topology.flat(3), PlanOptions(schedule="1f1b", num_microbatches=2)).to_json()


@BOUNDED
@given(data=st.data(), fmt=st.sampled_from(["text", "json", "markdown"]))
def test_pd_plan_diff_of_a_plan_edited_at_random_diffs_or_refuses_it_naming_the_file(
        data: st.DataObject, fmt: str, real_plan: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> None:
    from typer.testing import CliRunner

    from pdcli.cli import app

    d = tmp_path_factory.mktemp("plans")
    (d / "a.json").write_text(json.dumps(real_plan))
    (d / "b.json").write_text(json.dumps(_edited(real_plan, data)))
    result = CliRunner().invoke(app, ["plan", "diff", str(d / "a.json"), str(d / "b.json"), "--format", fmt,
                                      "--fail-on-regression", "5"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code in (0, 1, 2), result.output
    if result.exit_code == 2:
        assert "b.json: not a pd plan" in result.output


@BOUNDED
@given(cut=st.integers(0, 10_000), flip=st.integers(0, 10_000))
def test_pd_plan_diff_of_a_truncated_or_changed_plan_diffs_or_refuses_it(
        cut: int, flip: int, real_plan: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> None:
    from typer.testing import CliRunner

    from pdcli.cli import app

    d = tmp_path_factory.mktemp("plans")
    (d / "a.json").write_text(json.dumps(real_plan))
    (d / "b.json").write_bytes(_damaged(json.dumps(real_plan).encode(), cut, flip))
    result = CliRunner().invoke(app, ["plan", "diff", str(d / "a.json"), str(d / "b.json")])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code in (0, 1, 2), result.output
    if result.exit_code == 2:
        assert "b.json" in result.output


# -- the run directory's manifest.json ----------------------------------------------------

def _run_with_profile(root: Path, real_profile: dict[str, Any]) -> Any:
    from pdcli.rundir import RunDir

    run = RunDir(root).create()
    run.write_json("profile.json", real_profile, "h")
    return run


@BOUNDED
@given(data=st.data())
def test_a_run_manifest_edited_at_random_is_read_or_refused_naming_it(
        data: st.DataObject, real_profile: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> None:
    """What every step asks of the run directory (`fresh`, `read_json`) with its manifest.json
    changed at one place: an answer, or a UserError naming a file of the run."""
    from pdcli.rundir import MANIFEST

    run = _run_with_profile(tmp_path_factory.mktemp("run"), real_profile)
    manifest = json.loads((run / MANIFEST).read_text())
    (run / MANIFEST).write_text(json.dumps(_edited(manifest, data)))
    try:
        if run.fresh("profile.json", "h"):
            run.read_json("profile.json")
    except UserError as e:
        assert str(run.path) in str(e)


@BOUNDED
@given(cut=st.integers(0, 10_000), flip=st.integers(0, 10_000))
def test_a_run_manifest_truncated_or_changed_on_disk_is_read_or_refused_naming_it(
        cut: int, flip: int, real_profile: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> None:
    from pdcli.rundir import MANIFEST

    run = _run_with_profile(tmp_path_factory.mktemp("run"), real_profile)
    (run / MANIFEST).write_bytes(_damaged((run / MANIFEST).read_bytes(), cut, flip))
    try:
        if run.fresh("profile.json", "h"):
            run.read_json("profile.json")
    except UserError as e:
        assert str(run.path) in str(e)


# -- checkpoints -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A complete two-stage checkpoint as pd writes it: each stage file's bytes and the marker's."""
    from torch import nn

    from pdcli.runtime import checkpoint

    train_dir = tmp_path_factory.mktemp("train")
    for k in range(2):
        module = nn.Linear(4, 4)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        module(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        checkpoint.save_stage(train_dir, 3, k, module, {}, optimizer, 3, {"num_optimizer_steps": 3})
    checkpoint.mark_complete(train_dir, 3, num_stages=2, keep=1)
    d = checkpoint.checkpoint_dir(train_dir, 3)
    return {p.name: p.read_bytes() for p in d.iterdir()}


@BOUNDED
@given(name=st.sampled_from(["stage_0.pt", "stage_1.pt", "COMPLETE"]), cut=st.integers(0, 1 << 20),
       flip=st.integers(0, 1 << 20))
def test_a_checkpoint_truncated_or_changed_is_refused_naming_the_file(
        name: str, cut: int, flip: int, checkpoint_files: dict[str, bytes], tmp_path_factory: pytest.TempPathFactory) -> None:
    """One file of a complete checkpoint cut short or with one bit flipped: reading each stage
    back (as `pd train --resume` does before any worker starts, and `pd export`) is refused with a
    UserError naming the damaged file or its marker, never loaded."""
    from pdcli.runtime import checkpoint

    train_dir = tmp_path_factory.mktemp("train")
    d = checkpoint.checkpoint_dir(train_dir, 3)
    d.mkdir(parents=True)
    for n, raw in checkpoint_files.items():
        (d / n).write_bytes(_damaged(raw, cut, flip) if n == name else raw)
    try:
        payloads = [checkpoint.load_stage_file(train_dir, 3, k) for k in range(2)]
    except UserError as e:
        assert name in str(e)
        return
    # read as written: only where the flipped bit fell in what the loads do not use (a key of the
    # marker they ignore), never in a stage file (its sha256 in the marker changes with any bit)
    assert name == "COMPLETE"
    for k, payload in enumerate(payloads):
        path = tmp_path_factory.mktemp("orig") / "stage.pt"
        path.write_bytes(checkpoint_files[f"stage_{k}.pt"])
        want = torch.load(path, weights_only=True)
        assert payload["model"].keys() == want["model"].keys()
        assert all(torch.equal(payload["model"][n], want["model"][n]) for n in want["model"])
