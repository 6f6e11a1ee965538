import numpy as np
import pytest

from saccade.scenes.mesh import SCENE_COLORS, Mesh, SceneObject, dominant_color_name, infer_support


def test_dominant_color_is_the_vote_of_the_vertices():
    colors = np.array([SCENE_COLORS["red"]] * 7 + [SCENE_COLORS["white"]] * 3) + 10
    assert dominant_color_name(colors) == "red"
    assert dominant_color_name(np.zeros((0, 3))) is None
    assert dominant_color_name([[100, 60, 30]]) == "brown"


def test_support_goes_to_the_highest_top_under_an_object():
    table = SceneObject(0, "table", "red", (0, 0, 0), (1, 1, 0.75))
    book = SceneObject(1, "book", "blue", (0.2, 0.2, 0.75), (0.4, 0.5, 0.8))
    cup = SceneObject(2, "cup", "green", (0.25, 0.25, 0.8), (0.3, 0.3, 0.9))
    ball = SceneObject(3, "ball", "green", (2, 2, 0), (2.2, 2.2, 0.2))
    assert [o.on for o in infer_support((table, book, cup, ball))] == [None, 0, 1, None]


def test_mesh_checks_its_shapes():
    with pytest.raises(ValueError, match="one V"):
        Mesh(np.zeros((3, 3)), np.array([[0, 1, 2]]), np.zeros((2, 3)), np.zeros(3))
    with pytest.raises(ValueError, match="face indices"):
        Mesh(np.zeros((3, 3)), np.array([[0, 1, 3]]), np.zeros((3, 3)), np.zeros(3))
