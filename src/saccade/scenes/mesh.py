"""What a mesh scene is: coloured triangles, labelled objects, a room box, and where a
camera may stand in it.

Coordinates are metres with Z up (ScanNet's convention); the floor is at `bounds_min[2]`.
Colours are per vertex (uint8 RGB). A textured mesh is sampled into vertex colours when it
is loaded (`loaders.load_mesh_file`): the renderer then needs no texture path, and scans,
the meshes we care about most, come with vertex colours anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from saccade.data.shapes import COLORS

# Object colours of generated scenes come from saccade.data.shapes.COLORS (words the tiny
# model's tokenizer knows). Real scans also hold whites, grays, blacks and browns, so the
# palette that names a scanned object's colour adds those neutrals.
SCENE_COLORS: dict[str, tuple[int, int, int]] = {
    **COLORS,
    "white": (235, 235, 235),
    "gray": (128, 128, 128),
    "black": (25, 25, 25),
    "brown": (120, 75, 40),
}

# How far the camera keeps from walls, floor and ceiling, and from objects' boxes (metres).
WALL_MARGIN_M = 0.2
OBJECT_MARGIN_M = 0.05


@dataclass
class Mesh:
    vertices_V3: np.ndarray  # float32, metres, Z up
    faces_F3: np.ndarray  # int64 indices into the vertices
    colors_V3: np.ndarray  # uint8 RGB per vertex
    object_ids_V: np.ndarray  # int32, SceneObject.id of each vertex, -1 for none

    def __post_init__(self) -> None:
        self.vertices_V3 = np.ascontiguousarray(self.vertices_V3, dtype=np.float32)
        self.faces_F3 = np.ascontiguousarray(self.faces_F3, dtype=np.int64).reshape(-1, 3)
        self.colors_V3 = np.ascontiguousarray(self.colors_V3, dtype=np.uint8)
        self.object_ids_V = np.ascontiguousarray(self.object_ids_V, dtype=np.int32)
        n = len(self.vertices_V3)
        if self.vertices_V3.shape != (n, 3) or self.colors_V3.shape != (n, 3) or self.object_ids_V.shape != (n,):
            raise ValueError(f"Mesh: vertices {self.vertices_V3.shape}, colors {self.colors_V3.shape} and "
                             f"object ids {self.object_ids_V.shape} must be (V, 3), (V, 3) and (V,) for one V")
        if len(self.faces_F3) and (self.faces_F3.min() < 0 or self.faces_F3.max() >= n):
            raise ValueError(f"Mesh: face indices must lie in [0, {n}), got [{self.faces_F3.min()}, "
                             f"{self.faces_F3.max()}]")

    @property
    def num_vertices(self) -> int:
        return len(self.vertices_V3)

    @property
    def num_faces(self) -> int:
        return len(self.faces_F3)


def concatenate(meshes: list[Mesh]) -> Mesh:
    """One mesh holding all of `meshes` (face indices shifted)."""
    offsets = np.cumsum([0] + [m.num_vertices for m in meshes])
    return Mesh(np.concatenate([m.vertices_V3 for m in meshes]) if meshes else np.zeros((0, 3)),
                np.concatenate([m.faces_F3 + o for m, o in zip(meshes, offsets)]) if meshes else np.zeros((0, 3)),
                np.concatenate([m.colors_V3 for m in meshes]) if meshes else np.zeros((0, 3)),
                np.concatenate([m.object_ids_V for m in meshes]) if meshes else np.zeros(0))


@dataclass(frozen=True)
class SceneObject:
    id: int
    label: str  # "chair", "cup", "table", ...
    color: str | None  # a SCENE_COLORS name; None where unknown
    bbox_min: tuple[float, float, float]
    bbox_max: tuple[float, float, float]
    on: int | None = None  # id of the object it stands on, where known

    @property
    def center(self) -> tuple[float, float, float]:
        return tuple((a + b) / 2 for a, b in zip(self.bbox_min, self.bbox_max))  # type: ignore[return-value]


@dataclass
class MeshScene:
    name: str
    mesh: Mesh
    objects: tuple[SceneObject, ...]
    bounds_min: tuple[float, float, float]  # the room's box; the floor is at bounds_min[2]
    bounds_max: tuple[float, float, float]
    wall_margin: float = WALL_MARGIN_M
    object_margin: float = OBJECT_MARGIN_M
    metadata: dict = field(default_factory=dict)

    def object(self, object_id: int) -> SceneObject:
        for obj in self.objects:
            if obj.id == object_id:
                return obj
        raise ValueError(f"scene {self.name!r} has no object {object_id}; its ids are "
                         f"{[o.id for o in self.objects]}")

    def check_pose(self, pose) -> str | None:
        """None when a camera may stand at `pose`, else a short reason an agent can read.
        The camera keeps `wall_margin` from the room's box and stays out of every object's
        box grown by `object_margin`. Only the position matters: any direction may be seen."""
        p = (pose.x, pose.y, pose.z)
        lo, hi, m = self.bounds_min, self.bounds_max, self.wall_margin
        if p[2] < lo[2]:
            return "below the floor"
        if p[2] > hi[2]:
            return "above the ceiling"
        if not (lo[0] <= p[0] <= hi[0] and lo[1] <= p[1] <= hi[1]):
            return "outside the room"
        if p[2] < lo[2] + m:
            return "too close to the floor"
        if p[2] > hi[2] - m:
            return "too close to the ceiling"
        if not (lo[0] + m <= p[0] <= hi[0] - m and lo[1] + m <= p[1] <= hi[1] - m):
            return "inside the wall"
        for obj in self.objects:
            if all(a - self.object_margin <= v <= b + self.object_margin
                   for v, a, b in zip(p, obj.bbox_min, obj.bbox_max)):
                return f"inside the {obj.label}"
        return None


def dominant_color_name(colors_V3: np.ndarray, palette: dict[str, tuple[int, int, int]] | None = None) -> str | None:
    """The palette name that most of these colours are nearest to (a vote over vertices, so
    a few stray vertices of another colour do not move it); None for no colours."""
    palette = SCENE_COLORS if palette is None else palette
    colors_V3 = np.asarray(colors_V3, dtype=np.float32).reshape(-1, 3)
    if not len(colors_V3):
        return None
    names = list(palette)
    palette_C3 = np.array([palette[n] for n in names], dtype=np.float32)
    distance_VC = ((colors_V3[:, None, :] - palette_C3[None]) ** 2).sum(-1)
    votes_C = np.bincount(distance_VC.argmin(1), minlength=len(names))
    return names[int(votes_C.argmax())]


def infer_support(objects: tuple[SceneObject, ...], *, gap_m: float = 0.08) -> tuple[SceneObject, ...]:
    """Objects with `on` filled in where geometry says so: A is on B when A's bottom is within
    `gap_m` of B's top and A's footprint centre lies over B's footprint. Of several
    candidates, the highest top wins (a cup on a book on a table is on the book). Objects
    whose `on` is already known keep it. Scans carry no support relation; this is how their
    "what is on the table" questions get answers."""
    out = []
    for a in objects:
        if a.on is not None:
            out.append(a)
            continue
        cx, cy = a.center[0], a.center[1]
        best, best_top = None, -np.inf
        for b in objects:
            if b.id == a.id or b.bbox_max[2] <= a.bbox_min[2] - gap_m or b.bbox_max[2] > a.bbox_min[2] + gap_m:
                continue
            # B must be larger under A, or two stacked books would each be "on" the other.
            if b.bbox_min[0] <= cx <= b.bbox_max[0] and b.bbox_min[1] <= cy <= b.bbox_max[1] \
                    and b.bbox_max[2] > best_top and b.bbox_max[2] < a.bbox_max[2]:
                best, best_top = b.id, b.bbox_max[2]
        out.append(SceneObject(a.id, a.label, a.color, a.bbox_min, a.bbox_max, best))
    return tuple(out)


def objects_from_vertices(mesh: Mesh, labels: dict[int, str], *, min_vertices: int = 1) -> tuple[SceneObject, ...]:
    """SceneObjects for the labelled ids of `mesh`: box from the object's vertices, colour
    named by `dominant_color_name`, support inferred. Ids with fewer than `min_vertices`
    vertices are left out."""
    objects = []
    for object_id, label in sorted(labels.items()):
        mask_V = mesh.object_ids_V == object_id
        if mask_V.sum() < min_vertices:
            continue
        points = mesh.vertices_V3[mask_V]
        objects.append(SceneObject(int(object_id), label, dominant_color_name(mesh.colors_V3[mask_V]),
                                   tuple(float(v) for v in points.min(0)), tuple(float(v) for v in points.max(0))))
    return infer_support(tuple(objects))
