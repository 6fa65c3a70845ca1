"""The job's secret comes from outside the network (`pdcli.runtime.handshake.job_secret`): the
launcher's environment on one host, the user's PD_JOB_SECRET / --secret-file on several; the
rendezvous store only where the user said --insecure-network (or under torchrun on one host)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch.distributed import HashStore

from pdcli.runtime import handshake
from pdcli.runtime.launcher import secret_for_workers


def test_a_given_secret_is_the_key_and_the_store_never_holds_it() -> None:
    store = HashStore()
    env = {handshake.SECRET_ENV: "correct horse"}
    assert handshake.job_secret(store, env) == handshake.secret_key("correct horse") == handshake.job_secret(store, env)
    assert len(handshake.secret_key("x")) == handshake.SECRET_BYTES
    assert not store.check([handshake.SECRET_KEY])


def test_without_a_secret_a_job_on_several_hosts_has_none() -> None:
    store = HashStore()
    for env in ({}, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}):
        with pytest.raises(handshake.NoSecret, match="PD_JOB_SECRET"):
            handshake.job_secret(store, env)
    assert not store.check([handshake.SECRET_KEY])


@pytest.mark.parametrize("env", [{handshake.INSECURE_ENV: "1"}, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}])
def test_the_store_shares_one_only_where_the_user_accepted_it_or_the_job_is_on_one_host(env: dict[str, str]) -> None:
    store = HashStore()
    first = handshake.job_secret(store, env)
    assert store.check([handshake.SECRET_KEY]) and handshake.job_secret(store, env) == first  # the first worker's


def test_the_launcher_gives_this_hosts_workers_a_new_secret_and_takes_it_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(handshake.SECRET_ENV, raising=False)
    seen = []
    for _ in range(2):
        with secret_for_workers():
            seen.append(os.environ[handshake.SECRET_ENV])
        assert handshake.SECRET_ENV not in os.environ
    assert seen[0] != seen[1] and len(bytes.fromhex(seen[0])) == handshake.SECRET_BYTES
    with secret_for_workers(one_host=False):  # several hosts and none given (--insecure-network): the store's
        assert handshake.SECRET_ENV not in os.environ
    monkeypatch.setenv(handshake.SECRET_ENV, "given")
    with secret_for_workers():
        assert os.environ[handshake.SECRET_ENV] == "given"  # several hosts: the user's, the same on every node
    assert os.environ[handshake.SECRET_ENV] == "given"


def test_a_secret_file_must_be_the_owners_alone(tmp_path: Path) -> None:
    path = tmp_path / "job.secret"
    path.write_text("abc\n")
    path.chmod(0o600)
    assert handshake.read_secret_file(path) == "abc\n"
    assert handshake.secret_key(handshake.read_secret_file(path)) == handshake.secret_key("abc")
    for mode in (0o640, 0o604):
        path.chmod(mode)
        with pytest.raises(ValueError, match="readable by others"):
            handshake.read_secret_file(path)
