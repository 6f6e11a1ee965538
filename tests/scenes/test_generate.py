import numpy as np
import pytest

from saccade.data.shapes import COLORS
from saccade.scenes.generate import generate_room, start_pose
from saccade.scenes.mesh import MeshScene


def test_rooms_are_deterministic_in_index_and_seed():
    a, b, c = generate_room(5, seed=1), generate_room(5, seed=1), generate_room(6, seed=1)
    np.testing.assert_array_equal(a.mesh.vertices_V3, b.mesh.vertices_V3)
    assert a.objects == b.objects and a.objects != c.objects


@pytest.mark.parametrize("index", range(12))
def test_rooms_are_small_labelled_and_consistent(index):
    scene = generate_room(index, seed=0)
    assert isinstance(scene, MeshScene) and scene.mesh.num_faces < 5000
    labels = [o.label for o in scene.objects]
    assert labels.count("table") == 1 and 1 <= labels.count("chair") <= 2
    ids = {o.id for o in scene.objects}
    assert [o.id for o in scene.objects] == list(range(len(scene.objects)))
    assert set(np.unique(scene.mesh.object_ids_V)) == ids | {-1}
    for obj in scene.objects:
        assert obj.color in COLORS
        assert all(lo <= hi for lo, hi in zip(obj.bbox_min, obj.bbox_max))
        assert all(scene.bounds_min[k] <= obj.bbox_min[k] and obj.bbox_max[k] <= scene.bounds_max[k] for k in range(3))
        if obj.on is not None:  # stands on its support's top (a shelf board is below the top)
            support = scene.object(obj.on)
            assert support.id in ids and obj.bbox_min[2] <= support.bbox_max[2] + 1e-5
    table = next(o for o in scene.objects if o.label == "table")
    cups = [o for o in scene.objects if o.label == "cup"]
    assert all(cup.on == table.id for cup in cups) and len(cups) <= 3


def test_cup_counts_vary_across_rooms():
    counts = {sum(o.label == "cup" for o in generate_room(i, seed=0).objects) for i in range(30)}
    assert counts == {0, 1, 2, 3}


def test_start_pose_is_free_and_bad_arguments_are_refused():
    scene = generate_room(0, seed=0)
    pose = start_pose(scene, np.random.default_rng(0))
    assert scene.check_pose(pose) is None
    with pytest.raises(ValueError, match="non-negative integer"):
        generate_room(-1, seed=0)
    with pytest.raises(ValueError, match="subset"):
        generate_room(0, seed=0, colors=("teal",))
