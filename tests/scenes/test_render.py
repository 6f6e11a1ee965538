"""The renderer against scenes whose views are known by hand."""

from dataclasses import replace

import numpy as np
import pytest

from saccade.scenes.camera import CameraPose
from saccade.scenes.generate import box_mesh, generate_room, quad_mesh
from saccade.scenes.mesh import MeshScene, SceneObject, concatenate
from saccade.scenes.render import (CachedRenderer, MeshRenderer, object_pixel_fraction,
                                   visible_fraction)

RED, BLUE, GRAY = (220, 30, 30), (30, 70, 225), (128, 128, 128)


def two_boxes_scene() -> MeshScene:
    """A 10 x 4 x 3 m room; a red 0.6 m box (id 0) centred at x=3, a blue 2 m box (id 1) at
    x=7, both on the camera's line of sight along +x at height 1."""
    room = [quad_mesh([(0, 0, 0), (10, 0, 0), (10, 4, 0), (0, 4, 0)], GRAY),
            quad_mesh([(10, 0, 0), (10, 0, 3), (10, 4, 3), (10, 4, 0)], GRAY)]
    red = box_mesh((2.7, 1.7, 0.7), (3.3, 2.3, 1.3), RED, 0)
    blue = box_mesh((6.0, 1.0, 0.0), (8.0, 3.0, 2.0), BLUE, 1)
    objects = (SceneObject(0, "box", "red", (2.7, 1.7, 0.7), (3.3, 2.3, 1.3)),
               SceneObject(1, "crate", "blue", (6.0, 1.0, 0.0), (8.0, 3.0, 2.0)))
    return MeshScene("two-boxes", concatenate([*room, red, blue]), objects, (0, 0, 0), (10, 4, 3))


@pytest.fixture(scope="module")
def renderer():
    return MeshRenderer(size=64, fov_deg=60, device="cpu", shading=0.0)


def test_a_box_ahead_fills_the_centre_with_its_colour(renderer):
    scene = two_boxes_scene()
    out = renderer.render_buffers(scene, CameraPose(0.5, 2.0, 1.0))
    assert tuple(out.rgb_HW3[32, 32]) == RED
    assert out.object_id_HW[32, 32] == 0
    # Turned away from the boxes, towards the near wall... there is none: nothing is hit.
    image = renderer.render(scene, CameraPose(0.5, 2.0, 1.0, yaw_deg=180, pitch_deg=30))
    assert image.size == (64, 64) and image.getpixel((32, 32)) == (0, 0, 0)


def test_the_near_box_hides_the_far_one_and_depth_is_its_distance(renderer):
    scene = two_boxes_scene()
    out = renderer.render_buffers(scene, CameraPose(0.5, 2.0, 1.0))
    assert out.depth_HW[32, 32] == pytest.approx(2.7 - 0.5, abs=1e-3)  # the red box's front face
    assert np.isinf(out.depth_HW).sum() > 0  # the left/right/top edges see no wall
    # Past the red box, the blue one is in front: the centre turns blue at the blue distance.
    out = renderer.render_buffers(scene, CameraPose(4.0, 2.0, 1.0))
    assert tuple(out.rgb_HW3[32, 32]) == BLUE and out.depth_HW[32, 32] == pytest.approx(2.0, abs=1e-3)
    # Looking back from there (yaw 180) the red box is in front again.
    out = renderer.render_buffers(scene, CameraPose(4.0, 2.0, 1.0, yaw_deg=180))
    assert tuple(out.rgb_HW3[32, 32]) == RED and out.depth_HW[32, 32] == pytest.approx(0.7, abs=1e-3)


def test_the_floor_under_the_camera_is_clipped_not_dropped(renderer):
    scene = two_boxes_scene()
    out = renderer.render_buffers(scene, CameraPose(0.5, 2.0, 1.0, pitch_deg=-60))
    # The floor quad runs behind the camera; clipped at the near plane it still covers the
    # bottom of the image. The bottom-centre pixel's ray (60 + 30 * 31.5/32 ~ 89.5 degrees
    # down) meets the floor 1 m below at a depth close to 1 / sin(60 + ...) along the axis.
    assert tuple(out.rgb_HW3[63, 32]) == GRAY
    assert 0.5 < out.depth_HW[63, 32] < 1.2


def test_poses_outside_or_inside_things_are_refused(renderer):
    scene = two_boxes_scene()
    for pose, reason in [(CameraPose(-1, 2, 1), "outside the room"), (CameraPose(0.1, 2, 1), "inside the wall"),
                         (CameraPose(3, 2, 1), "inside the box"), (CameraPose(3, 2, -0.5), "below the floor"),
                         (CameraPose(1, 2, 3.5), "above the ceiling")]:
        assert scene.check_pose(pose) == reason
        with pytest.raises(ValueError, match=reason):
            renderer.render_buffers(scene, pose)
    assert scene.check_pose(CameraPose(1, 2, 1)) is None


def test_object_fractions(renderer):
    scene = two_boxes_scene()
    pose = CameraPose(0.5, 2.0, 1.0)
    out = renderer.render_buffers(scene, pose)
    red = object_pixel_fraction(out, 0)
    # The red box's front face, 0.6 m wide at 2.2 m, is 0.6 / 2.2 * f pixels across.
    f = 32 / np.tan(np.radians(30))
    assert red == pytest.approx((0.6 / 2.2 * f) ** 2 / 64**2, rel=0.15)
    assert visible_fraction(renderer, scene, pose, 0, out) == 1.0
    assert 0.0 < visible_fraction(renderer, scene, pose, 1, out) < 0.9  # the red box hides part of it
    assert object_pixel_fraction(out, 99) == 0.0 and visible_fraction(renderer, scene, pose, 99, out) == 0.0


def test_cache_hits_on_the_same_quantised_pose_and_misses_on_another(renderer):
    scene = two_boxes_scene()
    cached = CachedRenderer(renderer, max_entries=2)
    first = cached.render_buffers(scene, CameraPose(0.5, 2.0, 1.0))
    again = cached.render_buffers(scene, CameraPose(0.52, 1.98, 1.01, yaw_deg=1.0))
    assert again is first and (cached.stats.hits, cached.stats.misses) == (1, 0 + 1)
    cached.render_buffers(scene, CameraPose(1.0, 2.0, 1.0))
    cached.render_buffers(scene, CameraPose(1.5, 2.0, 1.0))
    assert (cached.stats.hits, cached.stats.misses, cached.stats.evictions, len(cached)) == (1, 3, 1, 2)
    assert not first.rgb_HW3.flags.writeable  # shared by callers: read-only
    with pytest.raises(ValueError, match="outside the room"):
        cached.render_buffers(scene, CameraPose(-1, 2, 1))


def test_a_generated_room_renders_its_walls_everywhere():
    scene = generate_room(0, seed=0)
    out = MeshRenderer(size=48, device="cpu").render_buffers(scene, CameraPose(0.5, 0.5, 1.4, yaw_deg=45))
    assert np.isfinite(out.depth_HW).all()  # a closed room: every pixel sees something
    assert out.rgb_HW3.dtype == np.uint8 and out.object_id_HW.dtype == np.int32


def test_cache_checks_the_pose_given_and_renders_it_when_its_snap_would_be_refused(renderer):
    scene = replace(two_boxes_scene(), bounds_max=(10, 3.97, 3))  # the wall's margin ends at y = 3.77
    cached = CachedRenderer(renderer)
    pose = CameraPose(1.0, 3.76, 1.0)  # free, but its snap (y = 3.8) is inside the margin
    assert scene.check_pose(pose) is None and scene.check_pose(CameraPose(1.0, 3.8, 1.0)) == "inside the wall"
    assert cached.render_buffers(scene, pose).depth_HW.shape == (64, 64)
    assert cached.stats.misses == 1
