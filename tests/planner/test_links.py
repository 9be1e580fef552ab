"""Emulated links in the planner: ``links.scale``, one charge function, the plan file."""

from __future__ import annotations

import dataclasses
import doctest
import json
from pathlib import Path

import pytest
import yaml

import planner.cluster
from planner.cluster import Cluster, Link, allreduce_s, load_cluster, parse_cluster
from planner.costmodel import CostModel
from planner.plan import Plan
from planner.plan_file import load_plan
from planner.predict import ring_link, simulate_allreduce
from planner.sim.simulator import pipeline_specs, shard_ms
from profiler.errors import ConfigError
from tests.conftest import EXAMPLES
from tests.planner.simplan import make_plan, paper_cluster
from tests.planner.synth import synthetic_profiles

SCALE = 40.0


def emulated(scale: float = SCALE) -> Cluster:
    """The example emulated cluster (four nodes V, R, G, Q) with its links ``scale`` x slower."""
    return dataclasses.replace(load_cluster(EXAMPLES / "emulated_cluster.yaml"), link_scale=scale)


def test_scaled_link_charges_factor_times_the_written_link() -> None:
    link = Link(2e9, 50e-6)
    assert link.scaled(SCALE).time_s(1e6) == pytest.approx(SCALE * link.time_s(1e6))
    assert link.scaled(SCALE).time_s(0) == 0.0
    cl = emulated()
    v, r = cl.node("V"), cl.node("R")
    assert cl.links.between(v.name, r.name).time_s(1e6) == pytest.approx(
        SCALE * cl.inter_node.time_s(1e6)
    )
    assert cl.links.between("V", "V").time_s(1e6) == pytest.approx(
        SCALE * cl.intra_node.time_s(1e6)
    )
    assert cl.links.host.time_s(1e6) == pytest.approx(SCALE * cl.host_link.time_s(1e6))


def test_cost_model_charges_the_scaled_links() -> None:
    cl = emulated()
    profiles = synthetic_profiles(6, types=("TITAN V", "TITAN RTX"))
    v, r = (d for d in cl.devices if d.node in ("V", "R"))
    scaled = CostModel(profiles, cl.link).comm_ms(cl.link(v, r))
    plain = CostModel(profiles, cl.link).comm_ms(cl.inter_node)
    assert scaled[2] == pytest.approx(SCALE * plain[2])


def test_scale_on_a_real_cluster_is_refused_naming_the_field() -> None:
    doc = yaml.safe_load((EXAMPLES / "paper_cluster.yaml").read_text())
    doc.setdefault("links", {})["scale"] = 10
    with pytest.raises(ConfigError, match=r"links\.scale: 10 applies to emulated clusters only"):
        parse_cluster(doc, "c.yaml")


def test_cluster_file_scale_is_read_and_written_back() -> None:
    doc = yaml.safe_load((EXAMPLES / "emulated_cluster.yaml").read_text())
    doc["links"]["scale"] = 25
    cl = parse_cluster(doc)
    assert cl.link_scale == 25
    assert parse_cluster(cl.to_dict()).link_scale == 25
    assert "scale" not in dataclasses.replace(cl, link_scale=1.0).to_dict()["links"]


def two_stage_plan(cluster: Cluster) -> Plan:
    return make_plan([[("V", 1.0, 2.0), ("R", 1.0, 2.0)]], nm=2, cluster=cluster)


def test_plan_file_round_trip_keeps_links_and_scale(tmp_path: Path) -> None:
    plan = two_stage_plan(emulated())
    path = tmp_path / "plan.yaml"
    plan.save(path)
    back = load_plan(path)
    assert back.cluster.link_scale == SCALE
    assert back.cluster.links == plan.cluster.links


def test_old_plan_file_without_scale_loads_unscaled(tmp_path: Path) -> None:
    doc = two_stage_plan(emulated(1.0)).to_dict()
    assert "scale" not in doc["cluster"]["links"]  # what plan files written before looked like
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    assert load_plan(path).cluster.link_scale == 1.0


def test_simulator_push_pull_charge_is_the_shared_function() -> None:
    plain, scaled = (pipeline_specs(two_stage_plan(emulated(f)))[0] for f in (1.0, SCALE))
    for s in range(2):
        assert scaled.push_ms[s] + scaled.push_inter_ms[s] == pytest.approx(
            SCALE * (plain.push_ms[s] + plain.push_inter_ms[s])
        )
        assert scaled.pull_ms[s] == pytest.approx(SCALE * plain.pull_ms[s])
    cl = emulated()
    assert shard_ms(cl.links, "V", "R", 1e6) == pytest.approx(
        1e3 * SCALE * cl.inter_node.time_s(1e6)
    )


def test_allreduce_prediction_charges_the_scaled_ring() -> None:
    cl = emulated()
    ring = ring_link(cl, ["V", "R"])
    assert ring.time_s(1e6) == pytest.approx(SCALE * cl.inter_node.time_s(1e6))
    r = simulate_allreduce([10.0, 10.0], 8_000_000, ring, 32, ["V", "R"])
    assert r.allreduce_ms == pytest.approx(allreduce_s(ring, 8_000_000, 2) * 1e3)
    assert ring_link(paper_cluster(), ["V"]) == paper_cluster().intra_node  # real: unscaled


def test_doctests() -> None:
    res = doctest.testmod(planner.cluster)
    assert res.attempted >= 3 and res.failed == 0
