"""Loaders read files written in each layout: ScanNet folders (written by
write_scannet_layout), ARKitScenes meshes with box annotations, and trimesh formats."""

import json

import numpy as np
import pytest
import trimesh

from saccade.scenes.generate import generate_room, write_ply, write_scannet_layout
from saccade.scenes.loaders import load_arkitscenes_mesh, load_mesh_file, load_scannet_scene, load_scene


def test_a_generated_room_round_trips_through_the_scannet_layout(tmp_path):
    scene = generate_room(3, seed=0)
    folder = write_scannet_layout(scene, tmp_path / scene.name)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [f"{scene.name}_vh_clean_2.ply", f"{scene.name}_vh_clean_2.0.010000.segs.json",
         f"{scene.name}.aggregation.json"])
    loaded = load_scene(folder)
    assert loaded.name == scene.name
    assert loaded.mesh.num_vertices == scene.mesh.num_vertices and loaded.mesh.num_faces == scene.mesh.num_faces
    np.testing.assert_array_equal(loaded.mesh.object_ids_V, scene.mesh.object_ids_V)
    np.testing.assert_array_equal(loaded.mesh.colors_V3, scene.mesh.colors_V3)
    assert [o.label for o in loaded.objects] == [o.label for o in scene.objects]
    assert [o.color for o in loaded.objects] == [o.color for o in scene.objects]
    # What stands on what is inferred back from the geometry.
    assert [o.on for o in loaded.objects] == [o.on for o in scene.objects]
    for a, b in zip(loaded.objects, scene.objects):
        np.testing.assert_allclose(a.bbox_min, b.bbox_min, atol=1e-5)
        np.testing.assert_allclose(a.bbox_max, b.bbox_max, atol=1e-5)


def test_scannet_axis_alignment_is_applied(tmp_path):
    scene = generate_room(1, seed=0)
    folder = write_scannet_layout(scene, tmp_path / scene.name)
    (folder / f"{scene.name}.txt").write_text("axisAlignment = 1 0 0 10 0 1 0 0 0 0 1 0 0 0 0 1\n")
    loaded = load_scannet_scene(folder)
    np.testing.assert_allclose(loaded.bounds_min[0], scene.bounds_min[0] + 10, atol=1e-5)


def test_segments_that_do_not_match_the_mesh_are_refused(tmp_path):
    scene = generate_room(1, seed=0)
    folder = write_scannet_layout(scene, tmp_path / scene.name)
    segs = folder / f"{scene.name}_vh_clean_2.0.010000.segs.json"
    segs.write_text(json.dumps({"segIndices": [0, 1, 2]}))
    with pytest.raises(ValueError, match="same scan"):
        load_scannet_scene(folder)


def test_an_arkitscenes_mesh_gets_its_objects_from_the_annotated_boxes(tmp_path):
    scene = generate_room(2, seed=0)
    write_ply(tmp_path / "41069025_3dod_mesh.ply", scene.mesh)
    table = next(o for o in scene.objects if o.label == "table")
    centroid = [(a + b) / 2 for a, b in zip(table.bbox_min, table.bbox_max)]
    lengths = [b - a + 0.01 for a, b in zip(table.bbox_min, table.bbox_max)]
    # A box turned 90 degrees about z: its local x is the world's y, so the lengths swap.
    turned = [0, 1, 0, -1, 0, 0, 0, 0, 1]
    data = [{"label": "table", "uid": "a", "segments": {"obbAligned": {
        "centroid": centroid, "axesLengths": [lengths[1], lengths[0], lengths[2]], "normalizedAxes": turned}}}]
    (tmp_path / "41069025_3dod_annotation.json").write_text(json.dumps({"data": data, "skipped": False}))
    loaded = load_scene(tmp_path)
    assert loaded.name == "41069025" and [o.label for o in loaded.objects] == ["table"]
    assert (loaded.mesh.object_ids_V == 0).sum() >= (scene.mesh.object_ids_V == table.id).sum()
    assert loaded.objects[0].color == table.color
    # Without the annotation: the mesh alone, no objects.
    (tmp_path / "41069025_3dod_annotation.json").unlink()
    assert load_arkitscenes_mesh(tmp_path / "41069025_3dod_mesh.ply").objects == ()


def test_obj_and_glb_load_through_trimesh_y_up_turned_to_z_up(tmp_path):
    box = trimesh.creation.box((1.0, 2.0, 0.5))  # 2 m along y: the up axis of these formats
    box.apply_translation((0, 1.0, 0))
    box.visual.vertex_colors = [30, 170, 50, 255]
    box.export(tmp_path / "box.glb")
    box.export(tmp_path / "box.obj")
    for name in ("box.glb", "box.obj"):
        scene = load_scene(tmp_path / name)
        np.testing.assert_allclose(scene.bounds_min, (-0.5, -0.25, 0.0), atol=1e-5)
        np.testing.assert_allclose(scene.bounds_max, (0.5, 0.25, 2.0), atol=1e-5)
        assert scene.objects == ()
    assert tuple(load_mesh_file(tmp_path / "box.glb").mesh.colors_V3[0]) == (30, 170, 50)


def test_a_textured_mesh_is_sampled_into_vertex_colours(tmp_path):
    from PIL import Image

    box = trimesh.creation.box((1.0, 1.0, 1.0))
    uv = np.zeros((len(box.vertices), 2)) + 0.5
    texture = Image.new("RGB", (4, 4), (245, 215, 20))
    box.visual = trimesh.visual.TextureVisuals(uv=uv, image=texture)
    box.export(tmp_path / "textured.glb")
    colors = load_mesh_file(tmp_path / "textured.glb").mesh.colors_V3
    np.testing.assert_allclose(colors.astype(int), np.tile([245, 215, 20], (len(colors), 1)), atol=2)


def test_an_unknown_layout_is_refused_naming_the_known_ones(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="ScanNet scene folder.*ARKitScenes.*mesh file"):
        load_scene(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        load_scene(tmp_path / "missing")
