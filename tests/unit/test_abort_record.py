"""The record that stops every node: signed with the job's token when the nodes share one, so
a stranger who can reach the store cannot stop the job with it."""

from __future__ import annotations

from ddpkit.launch.peers.liveness import Abort

ABORT = Abort(1, "node 1 (node1): rank 3 exited with code 3", 1, restart=False)


def test_an_abort_record_reads_back_as_written(monkeypatch):
    monkeypatch.delenv("DDPKIT_JOB_TOKEN", raising=False)
    assert Abort.from_json(ABORT.to_json()) == ABORT


def test_with_a_token_only_records_signed_with_it_are_taken(monkeypatch):
    monkeypatch.setenv("DDPKIT_JOB_TOKEN", "s3cret")
    signed = ABORT.to_json()
    assert Abort.from_json(signed) == ABORT
    monkeypatch.setenv("DDPKIT_JOB_TOKEN", "other")
    assert Abort.from_json(signed) is None
    monkeypatch.delenv("DDPKIT_JOB_TOKEN")
    assert Abort.from_json(signed) is None, "a signed record needs the token to be read"


def test_an_unsigned_record_is_refused_when_the_job_has_a_token(monkeypatch):
    monkeypatch.delenv("DDPKIT_JOB_TOKEN", raising=False)
    forged = ABORT.to_json()
    monkeypatch.setenv("DDPKIT_JOB_TOKEN", "s3cret")
    assert Abort.from_json(forged) is None
    assert Abort.from_json("not json") is None
