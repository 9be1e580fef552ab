"""The lm benchmark's Markov chains (benchmarks/lm_task.py) and lm_staleness.py's pure parts."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.lm_staleness import reach
from benchmarks.lm_task import CHAINS, Chain, entropy_nats, markov_tokens
from profiler.errors import ConfigError


def conditional_entropy(ids: torch.Tensor, symbols: int) -> float:
    """Plug-in estimate of the next-token entropy of sequences ``ids`` (N, T), in nats."""
    x, y = ids[:, :-1].reshape(-1), ids[:, 1:].reshape(-1)
    counts = torch.zeros(symbols, symbols)
    counts.index_put_((x, y), torch.ones(len(x)), accumulate=True)
    p = counts / counts.sum(1, keepdim=True).clamp(min=1)
    return float(-(counts * torch.where(p > 0, p.log(), 0.0)).sum() / counts.sum())


def test_the_default_chain_draws_the_sequences_it_always_drew() -> None:
    ids = markov_tokens(300, 3).tensors[0]  # figures of the code before Chain existed
    assert ids[0, :8].tolist() == [42, 21, 54, 52, 12, 63, 62, 57]
    assert int(ids.sum()) == 303197
    assert int((ids * torch.arange(32)).sum()) == 4738143
    assert torch.equal(markov_tokens(300, 3, CHAINS["default"]).tensors[0], ids)
    assert entropy_nats() == pytest.approx(1.5776, abs=1e-4)  # bench_tta's target 1.6: 0.022 above


@pytest.mark.parametrize(
    "chain", [Chain(symbols=8, stick=0.9, branch=2), Chain(symbols=16, stick=0.5)]
)
def test_a_chain_has_the_entropy_it_states(chain: Chain) -> None:
    ids = markov_tokens(2000, 0, chain).tensors[0]
    assert conditional_entropy(ids, chain.symbols) == pytest.approx(chain.entropy_nats(), abs=0.02)


def test_branch_rule_successors_are_all_drawn_and_nothing_else() -> None:
    chain = Chain(symbols=8, stick=1.0, branch=2)
    ids = markov_tokens(200, 0, chain).tensors[0]
    x, y = ids[:, :-1], ids[:, 1:]
    first, second = (5 * x + 3) % 8, (5 * x + 3 + 4) % 8
    assert bool(((y == first) | (y == second)).all())
    assert 0.45 < float((y == first).float().mean()) < 0.55
    assert chain.entropy_nats() == pytest.approx(math.log(2))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"symbols": 513}, "symbols 513"), ({"stick": 1.5}, "stick 1.5"), ({"branch": 0}, "branch 0")],
)
def test_a_chain_out_of_range_is_refused_in_one_line(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=f"Chain {field}: give") as err:
        Chain(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_reach_is_the_first_point_at_or_below_each_target() -> None:
    curve = [(0, -4.2), (1024, -2.0), (2048, -1.7), (3072, -1.75)]  # (samples, minus loss)
    got = reach(curve, {"0.4": 2.0, "0.1": 1.7, "0.05": 1.65})
    assert got == {"0.4": 1024, "0.1": 2048, "0.05": None}


def test_the_chain_variants_load_as_keyword_samples_of_their_chain() -> None:
    from benchmarks.tta_tasks import LM_TEST, LM_TRAIN, lm_branchy_data, lm_data, lm_wide_data

    for data, chain in ((lm_wide_data, "wide"), (lm_branchy_data, "branchy")):
        train, test = data(seed=5)
        assert (len(train), len(test)) == (LM_TRAIN, LM_TEST)
        want = markov_tokens(LM_TEST, 1, CHAINS[chain]).tensors[0]
        assert torch.equal(test.ids, want) and train[0]["input_ids"].shape == (32,)
    assert not torch.equal(lm_data()[0].ids, lm_wide_data()[0].ids)


def test_the_noise_scale_at_the_start_is_small_only_with_unused_ids() -> None:
    from torch.utils.data import Subset

    from benchmarks.lm_staleness import Trainer, trained_noise

    phi = {}
    for name in ("default", "wide"):
        train, test = markov_tokens(512, 0, CHAINS[name]), markov_tokens(8, 1, CHAINS[name])
        tr = Trainer(16, 0, test)
        phi[name] = trained_noise(tr, tr.w0, Subset(train, list(range(512))), 16, draws=4)
    assert 0 < phi["default"] < 20 < phi["wide"]  # measured 3 and 104 (docs/convergence.md)
