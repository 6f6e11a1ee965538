"""Procedural rooms: a floor, four walls and a ceiling, furniture-like boxes (table, chairs,
shelf, bed, cabinet) and small labelled objects (cups, books, balls) on the furniture or the
floor, each object one colour from `saccade.data.shapes.COLORS`. Counts vary (0-3 cups on
the table, ...), so "how many cups are on the table?" and "what colour is the chair?" have
answers from the labels (`SceneObject.on` records what stands on what).

`generate_room(index, seed=...)` is a pure function of (index, seed) and its arguments.
Meshes stay small (about a thousand triangles) so that rendering is fast.
`write_scannet_layout` saves a room as a ScanNet scene folder, which
`loaders.load_scannet_scene` reads back: tests and the demo get "ScanNet" scenes offline.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from saccade.data.shapes import COLORS
from saccade.scenes.camera import CameraPose
from saccade.scenes.mesh import Mesh, MeshScene, SceneObject, concatenate

ROOM_HEIGHT_M = 2.6
WALL_RGB = (200, 196, 188)
FLOOR_RGB = (150, 130, 110)
CEILING_RGB = (225, 225, 228)
# Footprint (x, y) and height of each piece of furniture, metres.
FURNITURE: dict[str, tuple[float, float, float]] = {
    "table": (1.2, 0.8, 0.75),
    "chair": (0.45, 0.45, 0.9),
    "shelf": (0.8, 0.35, 1.6),
    "bed": (1.4, 2.0, 0.5),
    "cabinet": (0.9, 0.45, 0.9),
}
SMALL_OBJECTS = ("cup", "book", "ball")


# ----------------------------------------------------------------------------- primitives


def box_mesh(lo, hi, rgb, object_id: int) -> Mesh:
    """An axis-aligned box from corner `lo` to corner `hi`, 8 vertices, 12 faces."""
    (x0, y0, z0), (x1, y1, z1) = lo, hi
    v = np.array([[x0, y0, z0], [x1, y0, z0], [x1, y1, z0], [x0, y1, z0],
                  [x0, y0, z1], [x1, y0, z1], [x1, y1, z1], [x0, y1, z1]], dtype=np.float32)
    f = np.array([[0, 2, 1], [0, 3, 2], [4, 5, 6], [4, 6, 7], [0, 1, 5], [0, 5, 4],
                  [1, 2, 6], [1, 6, 5], [2, 3, 7], [2, 7, 6], [3, 0, 4], [3, 4, 7]])
    return Mesh(v, f, np.tile(np.array(rgb, np.uint8), (8, 1)), np.full(8, object_id))


def quad_mesh(corners, rgb, object_id: int = -1) -> Mesh:
    """A planar quad (4 corners in order) as two triangles."""
    return Mesh(np.array(corners, dtype=np.float32), np.array([[0, 1, 2], [0, 2, 3]]),
                np.tile(np.array(rgb, np.uint8), (4, 1)), np.full(4, object_id))


def cylinder_mesh(x: float, y: float, z0: float, radius: float, height: float, rgb, object_id: int,
                  sides: int = 12) -> Mesh:
    """A closed cylinder standing at (x, y, z0)."""
    angle = np.arange(sides) * 2 * np.pi / sides
    ring = np.stack([x + radius * np.cos(angle), y + radius * np.sin(angle)], 1)
    v = np.concatenate([np.c_[ring, np.full(sides, z0)], np.c_[ring, np.full(sides, z0 + height)],
                        [[x, y, z0], [x, y, z0 + height]]])
    i, j = np.arange(sides), (np.arange(sides) + 1) % sides
    bottom, top = 2 * sides, 2 * sides + 1
    f = np.concatenate([np.c_[i, j, j + sides], np.c_[i, j + sides, i + sides],
                        np.c_[np.full(sides, bottom), j, i], np.c_[np.full(sides, top), i + sides, j + sides]])
    return Mesh(v, f, np.tile(np.array(rgb, np.uint8), (len(v), 1)), np.full(len(v), object_id))


def sphere_mesh(center, radius: float, rgb, object_id: int, rings: int = 6, segments: int = 10) -> Mesh:
    """A UV sphere."""
    theta = np.linspace(0, np.pi, rings + 1)[1:-1]
    phi = np.arange(segments) * 2 * np.pi / segments
    t, p = np.meshgrid(theta, phi, indexing="ij")
    ring_pts = np.stack([np.sin(t) * np.cos(p), np.sin(t) * np.sin(p), np.cos(t)], -1).reshape(-1, 3)
    v = np.concatenate([[[0, 0, 1]], ring_pts, [[0, 0, -1]]]) * radius + np.asarray(center)
    faces = []
    south = len(v) - 1
    for s in range(segments):
        n = (s + 1) % segments
        faces.append([0, 1 + s, 1 + n])
        faces.append([south, 1 + (rings - 2) * segments + n, 1 + (rings - 2) * segments + s])
        for r in range(rings - 2):
            a, b = 1 + r * segments + s, 1 + r * segments + n
            faces += [[a, a + segments, b], [b, a + segments, b + segments]]
    return Mesh(v, np.array(faces), np.tile(np.array(rgb, np.uint8), (len(v), 1)), np.full(len(v), object_id))


def _bounds(mesh: Mesh) -> tuple[tuple[float, ...], tuple[float, ...]]:
    return tuple(float(c) for c in mesh.vertices_V3.min(0)), tuple(float(c) for c in mesh.vertices_V3.max(0))


# ----------------------------------------------------------------------------- furniture


def furniture_mesh(label: str, x: float, y: float, rgb, object_id: int) -> tuple[Mesh, list[float]]:
    """The piece `label` with its footprint's low corner at (x, y), and the heights of the
    surfaces small objects may stand on."""
    sx, sy, h = FURNITURE[label]
    parts: list[Mesh] = []
    if label == "table":
        parts.append(box_mesh((x, y, h - 0.05), (x + sx, y + sy, h), rgb, object_id))
        for lx, ly in ((x, y), (x + sx - 0.06, y), (x, y + sy - 0.06), (x + sx - 0.06, y + sy - 0.06)):
            parts.append(box_mesh((lx, ly, 0), (lx + 0.06, ly + 0.06, h - 0.05), rgb, object_id))
        surfaces = [h]
    elif label == "chair":
        seat = 0.45
        parts.append(box_mesh((x, y, seat - 0.05), (x + sx, y + sy, seat), rgb, object_id))
        parts.append(box_mesh((x, y + sy - 0.05, seat), (x + sx, y + sy, h), rgb, object_id))
        for lx, ly in ((x, y), (x + sx - 0.04, y), (x, y + sy - 0.04), (x + sx - 0.04, y + sy - 0.04)):
            parts.append(box_mesh((lx, ly, 0), (lx + 0.04, ly + 0.04, seat - 0.05), rgb, object_id))
        surfaces = []
    elif label == "shelf":
        parts.append(box_mesh((x, y + sy - 0.03, 0), (x + sx, y + sy, h), rgb, object_id))  # back
        parts.append(box_mesh((x, y, 0), (x + 0.03, y + sy, h), rgb, object_id))
        parts.append(box_mesh((x + sx - 0.03, y, 0), (x + sx, y + sy, h), rgb, object_id))
        boards = [0.02, 0.55, 1.1, h]
        for z in boards:
            parts.append(box_mesh((x, y, z - 0.02), (x + sx, y + sy, z), rgb, object_id))
        surfaces = boards[1:-1]  # books stand on the middle boards, under the next board
    else:  # bed, cabinet: solid boxes
        parts.append(box_mesh((x, y, 0), (x + sx, y + sy, h), rgb, object_id))
        surfaces = [h]
    return concatenate(parts), surfaces


def small_object_mesh(label: str, x: float, y: float, z: float, rgb, object_id: int, rng) -> Mesh:
    """A small object with its footprint centred at (x, y), standing at height z."""
    if label == "cup":
        return cylinder_mesh(x, y, z, 0.045, 0.11, rgb, object_id)
    if label == "book":
        w, d = (0.17, 0.24) if rng.random() < 0.5 else (0.24, 0.17)
        return box_mesh((x - w / 2, y - d / 2, z), (x + w / 2, y + d / 2, z + 0.05), rgb, object_id)
    return sphere_mesh((x, y, z + 0.11), 0.11, rgb, object_id)  # ball


SMALL_FOOTPRINT_M = {"cup": 0.1, "book": 0.26, "ball": 0.23}


# ----------------------------------------------------------------------------- rooms


def _free(rect, placed, clearance: float) -> bool:
    x0, y0, x1, y1 = rect
    return all(x1 + clearance <= a0 or a1 + clearance <= x0 or y1 + clearance <= b0 or b1 + clearance <= y0
               for a0, b0, a1, b1 in placed)


def generate_room(index: int, *, seed: int, colors: tuple[str, ...] = tuple(COLORS),
                  max_cups: int = 3, max_books: int = 2, max_balls: int = 2) -> MeshScene:
    """Room `index` of the stream for `seed` (see the module docstring). Always a table;
    1-2 chairs; a shelf, a bed and a cabinet each with probability 1/2. Cups (0..max_cups)
    and books go on the table, books on the shelf, balls on the floor or the bed."""
    for name, value in (("index", index), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise ValueError(f"generate_room: {name} must be a non-negative integer, got {value!r}")
    unknown = [c for c in colors if c not in COLORS]
    if unknown or not colors:
        raise ValueError(f"generate_room: colors {list(colors)} must be a non-empty subset of {list(COLORS)}")
    rng = np.random.default_rng([seed, index, 20])
    width, depth = float(rng.uniform(4.0, 6.5)), float(rng.uniform(3.5, 5.5))
    height = ROOM_HEIGHT_M
    # The room's six sides as single quads (2 triangles each), not boxes: the renderer does no
    # culling, and a box's hidden outer faces would cover the whole image for nothing.
    w, d, h = width, depth, height
    parts: list[Mesh] = [
        quad_mesh([(0, 0, 0), (w, 0, 0), (w, d, 0), (0, d, 0)], FLOOR_RGB),
        quad_mesh([(0, 0, h), (0, d, h), (w, d, h), (w, 0, h)], CEILING_RGB),
        quad_mesh([(0, 0, 0), (0, d, 0), (0, d, h), (0, 0, h)], WALL_RGB),
        quad_mesh([(w, 0, 0), (w, 0, h), (w, d, h), (w, d, 0)], WALL_RGB),
        quad_mesh([(0, 0, 0), (0, 0, h), (w, 0, h), (w, 0, 0)], WALL_RGB),
        quad_mesh([(0, d, 0), (w, d, 0), (w, d, h), (0, d, h)], WALL_RGB),
    ]
    objects: list[SceneObject] = []
    placed: list[tuple[float, float, float, float]] = []  # footprints on the floor
    surfaces: list[tuple[int, float, tuple[float, float, float, float]]] = []  # (id, z, rect)

    def color() -> str:
        return str(rng.choice(colors))

    def add(label: str, mesh: Mesh, col: str, on: int | None) -> int:
        lo, hi = _bounds(mesh)
        objects.append(SceneObject(len(objects), label, col, lo, hi, on))  # type: ignore[arg-type]
        parts.append(mesh)
        return len(objects) - 1

    wanted = ["table"] + ["chair"] * int(rng.integers(1, 3))
    wanted += [label for label in ("shelf", "bed", "cabinet") if rng.random() < 0.5]
    for label in wanted:
        sx, sy, _ = FURNITURE[label]
        for _ in range(50):  # rejection sampling; a piece that finds no room is left out
            x = float(rng.uniform(0.05, width - sx - 0.05))
            y = float(rng.uniform(0.05, depth - sy - 0.05))
            rect = (x, y, x + sx, y + sy)
            # 0.7 m between pieces: a camera (0.2 m margin) fits between any two.
            if _free(rect, placed, 0.7):
                col = color()
                mesh, tops = furniture_mesh(label, x, y, COLORS[col], len(objects))
                object_id = add(label, mesh, col, None)
                placed.append(rect)
                for z in tops:
                    inset = 0.05
                    surfaces.append((object_id, z, (x + inset, y + inset, x + sx - inset, y + sy - 0.05 - inset)))
                break

    def put(label: str, surface) -> None:
        owner, z, (x0, y0, x1, y1) = surface
        taken = [(o.bbox_min[0], o.bbox_min[1], o.bbox_max[0], o.bbox_max[1]) for o in objects
                 if o.on == owner and abs(o.bbox_min[2] - z) < 0.02]
        half = SMALL_FOOTPRINT_M[label] / 2
        for _ in range(30):
            if x1 - x0 < 2 * half or y1 - y0 < 2 * half:
                return
            x, y = float(rng.uniform(x0 + half, x1 - half)), float(rng.uniform(y0 + half, y1 - half))
            if _free((x - half, y - half, x + half, y + half), taken, 0.03):
                col = color()
                add(label, small_object_mesh(label, x, y, z, COLORS[col], len(objects), rng), col, owner)
                return

    by_label = {o.label: o.id for o in objects}
    table_top = next(s for s in surfaces if s[0] == by_label["table"])
    for _ in range(int(rng.integers(0, max_cups + 1))):
        put("cup", table_top)
    for _ in range(int(rng.integers(0, max_books + 1))):
        shelf_boards = [s for s in surfaces if objects[s[0]].label == "shelf"]
        put("book", shelf_boards[int(rng.integers(len(shelf_boards)))] if shelf_boards and rng.random() < 0.5
            else table_top)
    for _ in range(int(rng.integers(0, max_balls + 1))):
        beds = [s for s in surfaces if objects[s[0]].label == "bed"]
        if beds and rng.random() < 0.3:
            put("ball", beds[0])
        else:  # on the floor, clear of the furniture
            for _ in range(30):
                x, y = float(rng.uniform(0.3, width - 0.3)), float(rng.uniform(0.3, depth - 0.3))
                rect = (x - 0.12, y - 0.12, x + 0.12, y + 0.12)
                if _free(rect, placed, 0.3):
                    col = color()
                    add("ball", small_object_mesh("ball", x, y, 0.0, COLORS[col], len(objects), rng), col, None)
                    placed.append(rect)
                    break

    return MeshScene(f"room-{seed}-{index}", concatenate(parts), tuple(objects), (0.0, 0.0, 0.0),
                     (width, depth, height), metadata={"generator": "saccade.scenes.generate", "seed": seed,
                                                       "index": index})


def start_pose(scene: MeshScene, rng: np.random.Generator, *, height_m: float = 1.4,
               tries: int = 200) -> CameraPose:
    """A random pose where the camera may stand, at eye height, looking at the room's centre
    (level). Raises ValueError when no free spot is found in `tries` draws."""
    lo, hi, m = scene.bounds_min, scene.bounds_max, scene.wall_margin
    z = min(lo[2] + height_m, hi[2] - m - 0.01)
    cx, cy = (lo[0] + hi[0]) / 2, (lo[1] + hi[1]) / 2
    for _ in range(tries):
        x, y = float(rng.uniform(lo[0] + m, hi[0] - m)), float(rng.uniform(lo[1] + m, hi[1] - m))
        pose = CameraPose(x, y, z, math.degrees(math.atan2(cy - y, cx - x)), 0.0)
        if scene.check_pose(pose) is None:
            return pose
    raise ValueError(f"start_pose: found no free camera position in scene {scene.name!r} after {tries} draws")


# ----------------------------------------------------------------------------- ScanNet layout


def write_ply(path: Path, mesh: Mesh) -> None:
    """A binary little-endian PLY as ScanNet's *_vh_clean_2.ply: vertex x y z (float32) red
    green blue alpha (uchar), face vertex_indices (uchar count, int32 indices)."""
    n, f = mesh.num_vertices, mesh.num_faces
    header = (f"ply\nformat binary_little_endian 1.0\nelement vertex {n}\n"
              "property float x\nproperty float y\nproperty float z\n"
              "property uchar red\nproperty uchar green\nproperty uchar blue\nproperty uchar alpha\n"
              f"element face {f}\nproperty list uchar int vertex_indices\nend_header\n")
    vertex = np.zeros(n, dtype=[("xyz", "<f4", 3), ("rgba", "u1", 4)])
    vertex["xyz"] = mesh.vertices_V3
    vertex["rgba"][:, :3] = mesh.colors_V3
    vertex["rgba"][:, 3] = 255
    face = np.zeros(f, dtype=[("n", "u1"), ("idx", "<i4", 3)])
    face["n"] = 3
    face["idx"] = mesh.faces_F3
    with open(path, "wb") as out:
        out.write(header.encode("ascii"))
        out.write(vertex.tobytes())
        out.write(face.tobytes())


def write_scannet_layout(scene: MeshScene, folder: str | Path) -> Path:
    """Write `scene` as a ScanNet scene folder `folder`: `<name>_vh_clean_2.ply`,
    `<name>_vh_clean_2.0.010000.segs.json` (one segment per object, segment 0 for the
    unlabelled room) and `<name>.aggregation.json` (one segGroup per object, with its label).
    Returns the folder. Colours are not written as labels: a loader names them again from
    the vertex colours, as it must for a real scan."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = scene.name
    write_ply(folder / f"{name}_vh_clean_2.ply", scene.mesh)
    # Segment k + 1 is object k's; the room (id -1) is segment 0.
    seg_indices = (scene.mesh.object_ids_V.astype(np.int64) + 1).tolist()
    segs_name = f"{name}_vh_clean_2.0.010000.segs.json"
    (folder / segs_name).write_text(json.dumps({
        "params": {"kThresh": "0.0001", "segMinVerts": "20", "minPoints": "750", "maxPoints": "5000",
                   "thinThresh": "0.05", "flatThresh": "0.001", "minLength": "0.02", "maxLength": "1"},
        "sceneId": name, "segIndices": seg_indices}))
    groups = [{"id": o.id, "objectId": o.id, "segments": [o.id + 1], "label": o.label} for o in scene.objects]
    (folder / f"{name}.aggregation.json").write_text(json.dumps({
        "sceneId": f"scannet.{name}", "appId": "saccade.scenes.generate", "segGroups": groups,
        "segmentsFile": f"scannet.{segs_name}"}, indent=1))
    return folder
