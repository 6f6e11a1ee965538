"""Loading real scenes: ScanNet scene folders, ARKitScenes meshes, any .ply/.obj/.glb.

Every loader returns a `MeshScene` in metres with Z up, the room box taken from the mesh's
bounds. Labelled objects get a box from their vertices, a colour named from their vertex
colours (`dominant_color_name`) and, where geometry says so, what they stand on
(`infer_support`): scans record none of these.

Meshes are read with trimesh (`process=False`, so vertex order, which ScanNet's segment
files index, is kept). Textures are sampled into vertex colours at load.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from saccade.scenes.mesh import Mesh, MeshScene, objects_from_vertices

MESH_SUFFIXES = (".ply", ".obj", ".glb", ".gltf")
LAYOUTS = ("a ScanNet scene folder (scene*_vh_clean_2.ply, optionally its "
           "_vh_clean_2.0.010000.segs.json and .aggregation.json)",
           "an ARKitScenes mesh (*_3dod_mesh.ply, optionally *_3dod_annotation.json beside it)",
           f"a mesh file ({', '.join(MESH_SUFFIXES)})")
# glTF is Y-up by its specification, and most .obj exporters follow it; scans (.ply) are Z-up.
_Y_UP_TO_Z_UP_33 = np.array([[1, 0, 0], [0, 0, -1], [0, 1, 0]], dtype=np.float64)


def read_mesh(path: str | Path, *, up: str = "z") -> Mesh:
    """Vertices, faces and vertex colours of a mesh file (no object ids: all -1). `up` is the
    file's up axis, "z" or "y"; a Y-up file is turned to Z up. A mesh with no colours is
    light gray; a textured one has its texture sampled at each vertex's uv."""
    import trimesh  # late: only the loaders need it

    if up not in ("z", "y"):
        raise ValueError(f"read_mesh: up must be 'z' or 'y', got {up!r}")
    loaded = trimesh.load(str(path), force="mesh", process=False)
    vertices = np.asarray(loaded.vertices, dtype=np.float64)
    if up == "y":
        vertices = vertices @ _Y_UP_TO_Z_UP_33.T
    visual = loaded.visual
    if getattr(visual, "kind", None) == "texture":
        visual = visual.to_color()
    if getattr(visual, "kind", None) in ("vertex", "face"):
        colors = np.asarray(visual.vertex_colors)[:, :3]
    else:
        colors = np.full((len(vertices), 3), 200, dtype=np.uint8)
    return Mesh(vertices, np.asarray(loaded.faces), colors, np.full(len(vertices), -1))


def _scene(name: str, mesh: Mesh, labels: dict[int, str], **metadata) -> MeshScene:
    if mesh.num_vertices == 0:
        raise ValueError(f"scene {name!r}: the mesh has no vertices")
    lo, hi = mesh.vertices_V3.min(0), mesh.vertices_V3.max(0)
    return MeshScene(name, mesh, objects_from_vertices(mesh, labels), tuple(float(v) for v in lo),
                     tuple(float(v) for v in hi), metadata=dict(metadata))


def _axis_alignment(meta_txt: Path) -> np.ndarray | None:
    """ScanNet's scene<id>.txt line `axisAlignment = m00 m01 ... m33` (row-major 4x4), which
    turns the scan so that its walls lie along x and y; None when absent."""
    if not meta_txt.is_file():
        return None
    for line in meta_txt.read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "axisAlignment":
            return np.array([float(v) for v in value.split()], dtype=np.float64).reshape(4, 4)
    return None


def load_scannet_scene(folder: str | Path) -> MeshScene:
    """A ScanNet scene folder: `<scene>_vh_clean_2.ply` and, where present, the over-segmentation
    `<scene>_vh_clean_2.0.010000.segs.json` (`segIndices`: one segment id per vertex) and
    `<scene>.aggregation.json` (`segGroups`: objectId, label, segments), which give each
    vertex its object. `<scene>.txt`'s axisAlignment is applied when present."""
    folder = Path(folder)
    plys = sorted(p for p in folder.glob("*_vh_clean_2.ply"))
    if len(plys) != 1:
        raise ValueError(f"{folder}: a ScanNet scene folder holds exactly one *_vh_clean_2.ply, found "
                         f"{[p.name for p in plys]}")
    name = plys[0].name[: -len("_vh_clean_2.ply")]
    mesh = read_mesh(plys[0], up="z")
    align = _axis_alignment(folder / f"{name}.txt")
    if align is not None:
        vertices = mesh.vertices_V3.astype(np.float64) @ align[:3, :3].T + align[:3, 3]
        mesh = Mesh(vertices, mesh.faces_F3, mesh.colors_V3, mesh.object_ids_V)
    labels: dict[int, str] = {}
    segs_path = folder / f"{name}_vh_clean_2.0.010000.segs.json"
    agg_path = folder / f"{name}.aggregation.json"
    if segs_path.is_file() and agg_path.is_file():
        seg_indices = np.asarray(json.loads(segs_path.read_text())["segIndices"], dtype=np.int64)
        if len(seg_indices) != mesh.num_vertices:
            raise ValueError(f"{segs_path.name} has {len(seg_indices)} segIndices but the mesh has "
                             f"{mesh.num_vertices} vertices: are they from the same scan?")
        seg_to_object: dict[int, int] = {}
        for group in json.loads(agg_path.read_text())["segGroups"]:
            labels[int(group["objectId"])] = str(group["label"])
            for seg in group["segments"]:
                seg_to_object.setdefault(int(seg), int(group["objectId"]))
        # Vectorised lookup: segment ids are sparse and large, so map through sorted keys.
        keys = np.array(sorted(seg_to_object), dtype=np.int64)
        values = np.array([seg_to_object[k] for k in keys], dtype=np.int32)
        pos = np.searchsorted(keys, seg_indices).clip(max=max(len(keys) - 1, 0))
        found = (keys[pos] == seg_indices) if len(keys) else np.zeros(len(seg_indices), bool)
        object_ids = np.where(found, values[pos] if len(keys) else -1, -1).astype(np.int32)
        mesh = Mesh(mesh.vertices_V3, mesh.faces_F3, mesh.colors_V3, object_ids)
    return _scene(name, mesh, labels, source="scannet", path=str(folder), aligned=align is not None)


def load_arkitscenes_mesh(path: str | Path) -> MeshScene:
    """An ARKitScenes `<video_id>_3dod_mesh.ply`, with `<video_id>_3dod_annotation.json` beside
    it where present: each entry of its `data` is a label and an oriented box
    (`segments.obbAligned`, else `segments.obb`: centroid, axesLengths, normalizedAxes as a
    row-major 3x3 R with box-local = R (p - centroid)); a vertex belongs to the first box it
    lies in."""
    path = Path(path)
    if not path.name.endswith("_3dod_mesh.ply"):
        raise ValueError(f"{path}: an ARKitScenes mesh is named <video_id>_3dod_mesh.ply")
    video_id = path.name[: -len("_3dod_mesh.ply")]
    mesh = read_mesh(path, up="z")
    labels: dict[int, str] = {}
    annotation = path.with_name(f"{video_id}_3dod_annotation.json")
    if annotation.is_file():
        object_ids = np.full(mesh.num_vertices, -1, dtype=np.int32)
        points_V3 = mesh.vertices_V3.astype(np.float64)
        for object_id, entry in enumerate(json.loads(annotation.read_text()).get("data", [])):
            box = entry["segments"].get("obbAligned") or entry["segments"]["obb"]
            rotation_33 = np.asarray(box["normalizedAxes"], dtype=np.float64).reshape(3, 3)
            half_3 = np.asarray(box["axesLengths"], dtype=np.float64) / 2
            local_V3 = (points_V3 - np.asarray(box["centroid"], dtype=np.float64)) @ rotation_33.T
            inside_V = (np.abs(local_V3) <= half_3).all(1) & (object_ids == -1)
            object_ids[inside_V] = object_id
            labels[object_id] = str(entry["label"])
        mesh = Mesh(mesh.vertices_V3, mesh.faces_F3, mesh.colors_V3, object_ids)
    return _scene(video_id, mesh, labels, source="arkitscenes", path=str(path))


def load_mesh_file(path: str | Path, *, up: str | None = None) -> MeshScene:
    """Any mesh trimesh reads (.ply, .obj, .glb, .gltf), with no labels. `up` defaults to "z"
    for .ply (scans) and "y" for the others (glTF's convention, and most .obj exporters')."""
    path = Path(path)
    if path.suffix.lower() not in MESH_SUFFIXES:
        raise ValueError(f"{path}: load_mesh_file reads {', '.join(MESH_SUFFIXES)}")
    up = up or ("z" if path.suffix.lower() == ".ply" else "y")
    return _scene(path.stem, read_mesh(path, up=up), {}, source="mesh", path=str(path), up=up)


def load_scene(path: str | Path) -> MeshScene:
    """Whatever `path` holds, by its layout (LAYOUTS); a clear error naming them otherwise."""
    path = Path(path)
    if path.is_dir():
        if list(path.glob("*_vh_clean_2.ply")):
            return load_scannet_scene(path)
        arkit = sorted(path.glob("*_3dod_mesh.ply"))
        if len(arkit) == 1:
            return load_arkitscenes_mesh(arkit[0])
    elif path.is_file():
        if path.name.endswith("_3dod_mesh.ply"):
            return load_arkitscenes_mesh(path)
        if path.name.endswith("_vh_clean_2.ply"):
            return load_scannet_scene(path.parent)
        if path.suffix.lower() in MESH_SUFFIXES:
            return load_mesh_file(path)
    elif not path.exists():
        raise ValueError(f"{path} does not exist")
    raise ValueError(f"{path} is none of the layouts saccade reads: " + "; ".join(LAYOUTS))
