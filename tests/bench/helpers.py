"""Shared by the bench tests: the ``pdserve`` command-line parser and a made-up engine profile."""

import argparse

from bench import cli
from bench.plan.costmodel import StepCost
from bench.plan.profile import Profile


def parser():
    p = argparse.ArgumentParser(prog="pdserve")
    cli.add_parser(p.add_subparsers(dest="command", required=True))
    return p


def fake_profile(per_token_1=0.001, speedup_2=1.6):
    """One thread: 5 ms + 1 ms/token; two threads: ``speedup_2`` times faster
    (1.6x: two CPU threads rarely double a small model's speed)."""
    one = StepCost(0.005, per_token_1, 0.0, 0.0)
    two = StepCost(0.005 / speedup_2, per_token_1 / speedup_2, 0.0, 0.0)
    return Profile(
        "fake",
        "float32",
        "cpu",
        num_layers=4,
        kv_bytes_per_token=1024,
        step_costs={1: one, 2: two},
        fit_errors={1: 0.0, 2: 0.0},
        transfer_bandwidth=1e9,
        transfer_latency=1e-4,
        transfer_source="test",
    )
