"""The sampler pool's bookkeeping in the store (parallel/roles.py), on an in-process TCPStore:
a replica whose heartbeat stops for grpo.sampler_timeout_s is lost (and every other rank reads
it so), one that beats stays; a learner rank waiting for a lost replica's data step gives it
back once, and another replica claims it; rollouts travel in chunks under the store's limit."""

import datetime
import time

import torch
import torch.distributed as dist

from rlt_mega.parallel import roles
from rlt_mega.parallel.dims import free_port
from rlt_mega.parallel.roles import RoleStore, SamplerPool


def store() -> RoleStore:
    return RoleStore(dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=datetime.timedelta(seconds=10)))


def test_a_silent_replica_is_lost_and_a_beating_one_is_not(monkeypatch):
    monkeypatch.setattr(roles, "BEAT_S", 0.0)
    s = store()
    pool, other = SamplerPool(s, 2, 1, timeout_s=0.3), SamplerPool(s, 2, 1, timeout_s=60.0)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        s.count("beat/0/0", 1)  # replica 0 beats, replica 1 is silent
        pool.refresh()
        time.sleep(0.02)
    assert pool.alive() == [0] and "no heartbeat" in pool.lost[1]
    assert other.alive() == [0]  # read from lost/1, long before its own timeout


def test_a_lost_replicas_step_is_given_back_once_and_claimed_by_another():
    s = store()
    assert s.claim("owner/3", "", "1") and not s.claim("owner/3", "", "0")  # replica 1 holds data step 3
    s.claim("owner/3", "1", "")  # given back
    assert s.get("owner/3") == "" and s.claim("owner/3", "", "0")
    s.claim("owner/3", "1", "")  # a second learner rank gives it back late: replica 0 keeps it
    assert s.get("owner/3") == "0"


def test_a_message_larger_than_the_stores_limit_travels_in_chunks(monkeypatch):
    monkeypatch.setattr(roles, "CHUNK", 1000)
    s = store()
    obj = {"x": torch.arange(2000, dtype=torch.float64), "step": 7}
    assert s.put("roll/7/0/0", obj) > 3 * 1000
    got = s.take("roll/7/0/0")
    assert torch.equal(got["x"], obj["x"]) and got["step"] == 7 and not s.has("roll/7/0/0")


def test_the_pool_keys_are_checked():
    import pytest

    from rlt_mega.config import ConfigError, GRPOConfig

    with pytest.raises(ConfigError, match=r"grpo\.sampler_timeout_s=0: must be > 0"):
        GRPOConfig(sampler_replicas=1, sampler_timeout_s=0)
    with pytest.raises(ConfigError, match=r"grpo\.samplers_join=true with grpo\.sampler_replicas=0: set"):
        GRPOConfig(samplers_join=True)


class Planted:
    """A payload that would run code when unpickled (pickle calls os.system on load)."""

    def __reduce__(self):
        import os

        return (os.system, ("touch planted_by_a_pickle",))


def test_a_planted_pickle_in_the_store_is_refused_not_run(tmp_path, monkeypatch):
    import pickle

    import pytest

    from rlt_mega.parallel.roles import UntrustedMessage
    from rlt_mega.train.async_grpo import Generated, RolesStart, roles_types

    monkeypatch.chdir(tmp_path)
    s = store()
    s.trusted = roles_types()
    for payload in (pickle.dumps(Planted()), pickle.dumps({"ok": torch.ones(2), "bad": Planted()})):
        s.store.set("roll/0/0/0/0", payload)
        s.store.set("roll/0/0/0", "1")
        with pytest.raises(UntrustedMessage, match=r"roll/0/0/0.* refused, not run"):
            s.take("roll/0/0/0")
    assert not (tmp_path / "planted_by_a_pickle").exists()
    # what the roles write comes back: their records, tensors bit for bit
    start = RolesStart(first=2, end=5, version=1, order={"epoch": 0, "cursor": 4}, last=4)
    s.put("start", start)
    assert s.take("start", keep=True) == start and s.has("start")
    item = Generated(step=3, version=2, rounds=[], sampling={"rounds": 1.0}, order={"epoch": 1, "cursor": 2})
    s.put("roll/3/0/0", item)
    assert s.take("roll/3/0/0") == item
    s.trusted = ()  # a record type the reader does not list is refused as well
    s.put("start", start)
    with pytest.raises(UntrustedMessage):
        s.take("start")
