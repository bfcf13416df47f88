"""bench.micro.serve_path's pieces that need no cluster: TPOT from arrival times, CPU per thread
from /proc, and the colocated config it launches."""

import os
import threading
import time

import pytest

from bench.micro.serve_path import CpuMeter, cluster_config, tpot_ms


def test_tpot_is_the_time_from_first_to_last_piece_over_the_tokens_after_the_first():
    assert tpot_ms([10.0, 10.5, 11.0, 13.0], 7) == pytest.approx(3000 / 6)
    with pytest.raises(RuntimeError, match="no TPOT"):
        tpot_ms([1.0], 5)


def _spin(seconds: float, done: threading.Event | None = None, leave: threading.Event | None = None) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    if done is not None and leave is not None:
        done.set()
        leave.wait()  # /proc lists a thread's CPU only while it lives


def test_cpu_meter_puts_the_main_thread_apart_from_the_others():
    pid = os.getpid()
    done, leave = threading.Event(), threading.Event()
    worker = threading.Thread(target=_spin, args=(0.3, done, leave))
    try:
        with CpuMeter(pid, pid) as meter:
            worker.start()
            done.wait()
            _spin(0.1)
    finally:
        leave.set()
        worker.join()
    per_token = meter.per_token(10)
    # schedstat counts nanoseconds on a CPU: each side what it spun, and a little more (the loop, the start)
    assert 300 <= per_token["server_engine_cpu_ms"] * 10 < 320
    assert 100 <= per_token["server_loop_cpu_ms"] * 10 < 120
    assert 400 <= per_token["router_cpu_ms"] * 10 < 440


def test_the_cluster_is_the_colocated_config_with_the_model_dtype_threads_and_free_ports():
    config = cluster_config("/models/m", "float32", 3)
    assert config["model"] == "/models/m" and config["dtype"] == "float32"
    assert config["engine"]["num_threads"] == 3
    ports = [config["router"]["port"], *(inst["port"] for inst in config["colocated"])]
    assert len(set(ports)) == len(ports) and 8000 not in ports
