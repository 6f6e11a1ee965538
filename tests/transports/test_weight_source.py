"""What a collective sync sends, as vLLM's trainer engines take it (saccade.transports.source): the
plan as a `WeightSource` whose metadata is its iteration, CPU groups sent without a copy, and one
pass shared by several groups' engines in threads (each group made once, one that fails waited for
by nobody)."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("vllm", reason="the sources are vLLM's WeightSource")

from saccade.transports.source import PlanSource, SharedGroups, packed, views_of  # noqa: E402


@pytest.fixture(scope="module")
def plan(tiny_path):
    from saccade.models.lm import load_policy_lm
    from saccade.trainer.transfer_plan import GroupMaterializer

    return GroupMaterializer(load_policy_lm(tiny_path, dtype=torch.float32), tiny_path)


def test_the_metadata_is_what_iteration_yields_group_by_group(plan):
    source = PlanSource(plan)
    meta = source.metadata()
    assert [m.name for m in meta] == [n for g in source.groups() for n in g]
    assert len(source.groups()) == len(plan.groups) >= 3
    got = list(source)
    assert [n for n, _ in got] == [m.name for m in meta]
    assert all(t.dtype == m.dtype and tuple(t.shape) == m.shape for (_, t), m in zip(got, meta, strict=True))
    for (names, tensors), group in zip(source.iter_groups(), plan.groups, strict=True):
        assert torch.equal(packed(tensors), plan.materialize(group))  # the folder's bytes (test_transfer_plan)
    assert source.materialize_s > 0


def test_a_groups_views_are_sent_without_a_copy_and_other_tensors_are_packed():
    a, b = torch.randn(3, 4), torch.arange(5, dtype=torch.int16)
    buffer = torch.cat([a.reshape(-1).view(torch.uint8), b.view(torch.uint8)])
    views = views_of(buffer, [torch.float32, torch.int16], [(3, 4), (5,)])
    out = packed(views)
    assert out.data_ptr() == buffer.data_ptr() and torch.equal(out, buffer)  # the same bytes, no copy
    loose = packed([a, b])  # not views of one buffer: copied, back to back
    assert torch.equal(loose, buffer) and loose.data_ptr() != buffer.data_ptr()


def test_one_pass_serves_several_engines_each_group_made_once_in_order(plan):
    made = []
    source = PlanSource(plan)
    materialize = plan.materialize

    def counting(group):
        made.append(group[0].name)
        return materialize(group)
    plan.materialize = counting
    try:
        shared = SharedGroups(source, 3)
        seen = {0: [], 1: [], 2: []}

        def consume(i):
            try:
                for names, tensors in shared.view(i).iter_groups():
                    seen[i].append(names[0])
                    if i == 2:
                        raise RuntimeError("this server died")  # leaves after the first group: nobody waits for it
            except RuntimeError:
                pass
            finally:
                shared.leave(i)
        threads = [threading.Thread(target=consume, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        first_names = [g[0].name for g in plan.groups]
        assert seen[0] == seen[1] == first_names and seen[2] == first_names[:1]
        assert made == first_names  # each group made once, in order
    finally:
        plan.materialize = materialize
