"""P2P.wait_s, the pipeline's blocked time: host time around a blocking wait on the CPU (gloo);
reset by assignment, as RingSchedule does at each round. (On CUDA it is the compute stream's
stall, by events: tools/gpu_check_multi.sh measures the ring's bubble with it.)"""

import time

import torch

from rlt_mega.parallel.p2p import P2P


class _Work:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def wait(self) -> None:
        time.sleep(self.seconds)


def test_wait_s_sums_the_host_time_blocked_in_waits_and_resets():
    p2p = P2P([0], 0, torch.device("cpu"))
    buf = torch.zeros(2)
    assert p2p.wait((_Work(0.02), buf)) is buf
    p2p.wait((_Work(0.02), buf))
    assert 0.04 <= p2p.wait_s < 1.0
    p2p.wait_s = 0.0
    assert p2p.wait_s == 0.0
    p2p.send(buf, 0, "ring")  # a message to oneself: a local queue, no wait
    assert p2p.wait(p2p.post_recv((2,), torch.float32, 0, "ring")).data_ptr() == buf.data_ptr()
    assert p2p.wait_s == 0.0
