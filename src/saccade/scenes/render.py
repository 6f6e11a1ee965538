"""Rendering a mesh scene from a camera pose: a z-buffer rasterizer in PyTorch.

Why our own: pyrender (OpenGL through OSMesa) renders, but is unmaintained since 2021 and
pins PyOpenGL 3.1.0 and networkx 2.2, which fail on Python 3.11 and must be overridden;
Open3D's offscreen renderer needs EGL or an OSMesa build. A rasterizer in torch needs no
system package, runs on CUDA where there is one, and gives the object-id buffer exactly
(docs/scenes.md has the measurements).

How (one call of `rasterize`):
1. Vertices to camera space: (x right, y up, d = depth along the view axis).
2. Faces wholly behind the near plane or outside one side of the view frustum are dropped.
3. Faces crossing the near plane are clipped against it (one face becomes one or two), so
   a floor that runs under the camera still covers the image: a room is seen from inside,
   and every wall and the floor cross that plane.
4. Each face is scan-converted: for every pixel row it covers, the span between its edges'
   crossings of the row's centre line; the pixels of all spans are enumerated at once (in
   chunks, to bound memory), each with a depth from the face's plane of 1/d (1/d is linear
   in screen space).
5. The depth test is one `scatter_reduce(amin)` over int64 keys (depth bits << 32 | face):
   positive float32s order like their bit patterns, so the smallest key is the nearest
   face, and ties break by face index: deterministic on CPU and CUDA.
6. For each covered pixel, the winning face's barycentrics give the perspective-correct
   vertex colour; its object id is the face's.

No backface culling (scans' face orientation is not reliable, and rooms are seen from
inside). A small directional shading (`shading`) tells a box's faces apart; set it to 0
for scans, whose colours already hold their lighting.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from saccade.devices import resolve_device
from saccade.scenes.camera import CameraPose, camera_axes, quantized
from saccade.scenes.mesh import Mesh, MeshScene

_NO_HIT = torch.iinfo(torch.int64).max
_LIGHT_3 = np.array([0.5, 0.3, 0.81]) / np.linalg.norm([0.5, 0.3, 0.81])


@dataclass
class Rendered:
    rgb_HW3: np.ndarray  # uint8
    depth_HW: np.ndarray  # float32, metres along the view axis; inf where nothing was hit
    object_id_HW: np.ndarray  # int32, SceneObject.id; -1 where no labelled object

    @property
    def nbytes(self) -> int:
        return self.rgb_HW3.nbytes + self.depth_HW.nbytes + self.object_id_HW.nbytes

    def image(self) -> Image.Image:
        return Image.fromarray(self.rgb_HW3)


@dataclass
class _DeviceMesh:
    vertices_V3: torch.Tensor  # float32
    faces_F3: torch.Tensor  # int64
    colors_V3: torch.Tensor  # float32, 0..255
    face_ids_F: torch.Tensor  # int32
    face_shade_F: torch.Tensor  # float32, |normal . light| in [0, 1]


def face_object_ids(mesh: Mesh) -> np.ndarray:
    """Each face's object id: the id two or three of its vertices share, else its first
    vertex's (a face on the border between two segments goes to one of them)."""
    ids_F3 = mesh.object_ids_V[mesh.faces_F3]
    return np.where(ids_F3[:, 1] == ids_F3[:, 2], ids_F3[:, 1], ids_F3[:, 0]).astype(np.int32)


def face_light(mesh: Mesh) -> np.ndarray:
    """|n . light| per face for a fixed light direction; 1 for degenerate faces."""
    v_F33 = mesh.vertices_V3[mesh.faces_F3].astype(np.float64)
    n_F3 = np.cross(v_F33[:, 1] - v_F33[:, 0], v_F33[:, 2] - v_F33[:, 0])
    length_F = np.linalg.norm(n_F3, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        light_F = np.abs(n_F3 @ _LIGHT_3) / length_F
    return np.where(length_F > 0, light_F, 1.0).astype(np.float32)


def _clip_near(p_T33: torch.Tensor, c_T33: torch.Tensor, near: float):
    """Clip triangles (camera-space vertices p with depth in [..., 2], colours c) against the
    plane depth = near. Returns the kept/new triangles and, for each, its source index."""
    inside_T3 = p_T33[..., 2] > near
    n_in_T = inside_T3.sum(1)
    whole = torch.nonzero(n_in_T == 3).squeeze(1)
    out_p, out_c, out_src = [p_T33[whole]], [c_T33[whole]], [whole]
    for n_in in (1, 2):
        idx = torch.nonzero(n_in_T == n_in).squeeze(1)
        if not len(idx):
            continue
        # Rotate each triangle (keeping its winding) so that the odd vertex out is first:
        # the one inside when one is inside, the one outside when two are.
        odd_T3 = inside_T3[idx] if n_in == 1 else ~inside_T3[idx]
        k_T = odd_T3.float().argmax(1)
        order_T3 = (k_T[:, None] + torch.arange(3, device=p_T33.device)[None]) % 3
        p = torch.gather(p_T33[idx], 1, order_T3[..., None].expand(-1, -1, 3))
        c = torch.gather(c_T33[idx], 1, order_T3[..., None].expand(-1, -1, 3))
        a, b, cc = p[:, 0], p[:, 1], p[:, 2]
        ca, cb, ccc = c[:, 0], c[:, 1], c[:, 2]
        t_ab = ((a[:, 2] - near) / (a[:, 2] - b[:, 2]))[:, None]
        t_ac = ((a[:, 2] - near) / (a[:, 2] - cc[:, 2]))[:, None]
        ab, ac = a + t_ab * (b - a), a + t_ac * (cc - a)
        cab, cac = ca + t_ab * (cb - ca), ca + t_ac * (ccc - ca)
        if n_in == 1:  # a inside: the tip (a, ab, ac)
            out_p.append(torch.stack([a, ab, ac], 1))
            out_c.append(torch.stack([ca, cab, cac], 1))
            out_src.append(idx)
        else:  # a outside: the quad (ab, b, c, ac) as two triangles
            out_p += [torch.stack([ab, b, cc], 1), torch.stack([ab, cc, ac], 1)]
            out_c += [torch.stack([cab, cb, ccc], 1), torch.stack([cab, ccc, cac], 1)]
            out_src += [idx, idx]
    return torch.cat(out_p), torch.cat(out_c), torch.cat(out_src)


def _edge(ax, ay, bx, by, px, py):
    return (bx - ax) * (py - ay) - (by - ay) * (px - ax)


def rasterize(dm: _DeviceMesh, pose: CameraPose, *, size: int, fov_deg: float, near: float,
              shading: float, chunk_pixels: int = 1 << 21) -> Rendered:
    """Render `dm` from `pose` into a size x size image (see the module docstring)."""
    device = dm.vertices_V3.device
    right, up, forward = camera_axes(pose)
    axes_33 = torch.tensor(np.stack([right, up, forward], 1), dtype=torch.float32, device=device)
    eye_3 = torch.tensor(pose.position, dtype=torch.float32, device=device)
    cam_V3 = (dm.vertices_V3 - eye_3) @ axes_33  # (x right, y up, depth)
    p_F33 = cam_V3[dm.faces_F3]
    # Cull: behind the near plane, or wholly outside one side plane of the frustum (these
    # planes pass through the eye, so the test holds for vertices behind it too).
    t = math.tan(math.radians(fov_deg) / 2) * 1.01
    x, y, d = p_F33[..., 0], p_F33[..., 1], p_F33[..., 2]
    outside_F = ((d <= near).all(1) | (x > t * d).all(1) | (-x > t * d).all(1)
                 | (y > t * d).all(1) | (-y > t * d).all(1))
    keep_F = torch.nonzero(~outside_F).squeeze(1)
    p_T33, c_T33, src_T = _clip_near(p_F33[keep_F], dm.colors_V3[dm.faces_F3[keep_F]], near)
    face_T = keep_F[src_T]

    # Project: pixel (column, row) coordinates; rows grow downwards.
    f = (size / 2) / math.tan(math.radians(fov_deg) / 2)
    d_T3 = p_T33[..., 2]
    sx_T3 = size / 2 + f * p_T33[..., 0] / d_T3
    sy_T3 = size / 2 - f * p_T33[..., 1] / d_T3
    area_T = _edge(sx_T3[:, 0], sy_T3[:, 0], sx_T3[:, 1], sy_T3[:, 1], sx_T3[:, 2], sy_T3[:, 2])
    # Depth: 1/d is linear in screen space; each face's plane, anchored at its first vertex.
    inv_d_T3 = 1.0 / d_T3
    safe_area_T = torch.where(area_T.abs() > 1e-12, area_T, torch.ones_like(area_T))
    dx1, dy1 = sx_T3[:, 1] - sx_T3[:, 0], sy_T3[:, 1] - sy_T3[:, 0]
    dx2, dy2 = sx_T3[:, 2] - sx_T3[:, 0], sy_T3[:, 2] - sy_T3[:, 0]
    di1, di2 = inv_d_T3[:, 1] - inv_d_T3[:, 0], inv_d_T3[:, 2] - inv_d_T3[:, 0]
    plane_a_T = (di1 * dy2 - di2 * dy1) / safe_area_T
    plane_b_T = (di2 * dx1 - di1 * dx2) / safe_area_T

    # Scanlines: for each face, the rows whose pixel centres (row + 0.5) it spans...
    y0 = torch.ceil(sy_T3.min(1).values - 0.5).clamp(min=0).long()
    y1 = torch.floor(sy_T3.max(1).values - 0.5).clamp(max=size - 1).long()
    rows_T = torch.where(area_T.abs() > 1e-12, (y1 - y0 + 1).clamp(min=0), torch.zeros_like(y0))
    face_R = torch.repeat_interleave(torch.arange(len(rows_T), device=device), rows_T)
    row_R = y0[face_R] + torch.arange(len(face_R), device=device) - torch.repeat_interleave(
        torch.cumsum(rows_T, 0) - rows_T, rows_T)
    # ...and on each row, the span between the edges' crossings of that scanline: only
    # covered pixels are enumerated, never the empty half of a bounding box.
    cy_R = row_R.to(torch.float32) + 0.5
    xs_R3, ys_R3 = sx_T3[face_R], sy_T3[face_R]
    ya, yb = ys_R3, ys_R3.roll(-1, 1)
    xa, xb = xs_R3, xs_R3.roll(-1, 1)
    crosses = (torch.minimum(ya, yb) <= cy_R[:, None]) & (cy_R[:, None] <= torch.maximum(ya, yb)) & (ya != yb)
    x_at = xa + (cy_R[:, None] - ya) * (xb - xa) / torch.where(ya != yb, yb - ya, torch.ones_like(ya))
    left = torch.where(crosses, x_at, torch.full_like(x_at, float("inf"))).min(1).values
    right = torch.where(crosses, x_at, torch.full_like(x_at, float("-inf"))).max(1).values
    c0 = torch.ceil(left - 0.5).clamp(min=0, max=size).long()
    c1 = torch.floor(right - 0.5).clamp(min=-1, max=size - 1).long()
    width_R = (c1 - c0 + 1).clamp(min=0)

    # Per span: its first pixel's index and 1/d there, and the step of 1/d per column.
    pixel0_R = row_R * size + c0
    inv0_R = (inv_d_T3[face_R, 0] + plane_a_T[face_R] * (c0.to(torch.float32) + 0.5 - sx_T3[face_R, 0])
              + plane_b_T[face_R] * (cy_R - sy_T3[face_R, 0]))
    step_R = plane_a_T[face_R]

    zbuf = torch.full((size * size,), _NO_HIT, dtype=torch.int64, device=device)
    live = torch.nonzero(width_R > 0).squeeze(1)
    ends = torch.cumsum(width_R[live], 0)
    start = 0
    while start < len(live):
        # The spans whose pixels fit in this chunk (at least one span).
        base = ends[start - 1] if start else torch.zeros((), dtype=torch.int64, device=device)
        stop = max(start + 1, int(torch.searchsorted(ends, base + chunk_pixels, right=True)))
        spans = live[start:stop]
        counts = width_R[spans]
        si = torch.repeat_interleave(spans, counts)
        k = torch.arange(len(si), device=device) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        inv_depth = inv0_R[si] + step_R[si] * k.to(torch.float32)
        # At a sliver's edge the plane can overshoot past the eye: keep keys positive.
        depth = (1.0 / inv_depth).clamp(min=near)
        key = (depth.view(torch.int32).long() << 32) | face_R[si]
        zbuf.scatter_reduce_(0, pixel0_R[si] + k, key, reduce="amin")
        start = stop

    # Resolve: the winning face at each covered pixel, its colour and depth there.
    covered = torch.nonzero(zbuf != _NO_HIT).squeeze(1)
    tri = zbuf[covered] & 0xFFFFFFFF
    px = (covered % size).float() + 0.5
    py = torch.div(covered, size, rounding_mode="floor").float() + 0.5
    sx, sy, a, dd = sx_T3[tri], sy_T3[tri], area_T[tri], d_T3[tri]
    b_P3 = torch.stack([_edge(sx[:, 1], sy[:, 1], sx[:, 2], sy[:, 2], px, py),
                        _edge(sx[:, 2], sy[:, 2], sx[:, 0], sy[:, 0], px, py),
                        _edge(sx[:, 0], sy[:, 0], sx[:, 1], sy[:, 1], px, py)], 1) / a[:, None]
    persp_P3 = b_P3 / dd  # perspective-correct weights, normalised below
    persp_P3 = persp_P3 / persp_P3.sum(1, keepdim=True)
    color_P3 = (persp_P3[..., None] * c_T33[tri]).sum(1)
    light_P = 1.0 - shading * (1.0 - dm.face_shade_F[face_T[tri]])
    color_P3 = (color_P3 * light_P[:, None]).round().clamp(0, 255)

    rgb = torch.zeros((size * size, 3), dtype=torch.uint8, device=device)
    depth_buf = torch.full((size * size,), float("inf"), dtype=torch.float32, device=device)
    ids = torch.full((size * size,), -1, dtype=torch.int32, device=device)
    rgb[covered] = color_P3.to(torch.uint8)
    depth_buf[covered] = (zbuf[covered] >> 32).int().view(torch.float32)
    ids[covered] = dm.face_ids_F[face_T[tri]]
    return Rendered(rgb.view(size, size, 3).cpu().numpy(), depth_buf.view(size, size).cpu().numpy(),
                    ids.view(size, size).cpu().numpy())


class MeshRenderer:
    """Renders `MeshScene`s (see the module docstring); implements envs.views' `Renderer`
    protocol (`render(scene, pose) -> PIL image`) for them. Square images of `size` pixels
    and a horizontal = vertical field of view of `fov_deg`."""

    def __init__(self, size: int = 256, fov_deg: float = 60.0, device: str = "auto", *, near_m: float = 0.05,
                 shading: float = 0.25, max_meshes: int = 8):
        if size < 1:
            raise ValueError(f"MeshRenderer: size must be a positive number of pixels, got {size}")
        if not 1.0 <= fov_deg <= 170.0:
            raise ValueError(f"MeshRenderer: fov_deg must lie in [1, 170], got {fov_deg}")
        if not 0.0 <= shading <= 1.0:
            raise ValueError(f"MeshRenderer: shading must lie in [0, 1] (0 for scans), got {shading}")
        self.size, self.fov_deg, self.near_m, self.shading = size, fov_deg, near_m, shading
        self.device = resolve_device(device, setting="MeshRenderer device")
        # Meshes already on the device, by identity (the entry holds the mesh, so its id
        # cannot be reused while cached).
        self._meshes: OrderedDict[int, tuple[Mesh, _DeviceMesh]] = OrderedDict()
        self._max_meshes = max_meshes
        self._lock = threading.Lock()

    def _device_mesh(self, mesh: Mesh) -> _DeviceMesh:
        with self._lock:
            entry = self._meshes.get(id(mesh))
            if entry is not None and entry[0] is mesh:
                self._meshes.move_to_end(id(mesh))
                return entry[1]
            dev = self.device
            dm = _DeviceMesh(torch.from_numpy(mesh.vertices_V3).to(dev),
                             torch.from_numpy(mesh.faces_F3).to(dev),
                             torch.from_numpy(mesh.colors_V3).to(dev, torch.float32),
                             torch.from_numpy(face_object_ids(mesh)).to(dev),
                             torch.from_numpy(face_light(mesh)).to(dev))
            self._meshes[id(mesh)] = (mesh, dm)
            while len(self._meshes) > self._max_meshes:
                self._meshes.popitem(last=False)
            return dm

    def render_buffers(self, scene: MeshScene, pose: CameraPose) -> Rendered:
        reason = scene.check_pose(pose)
        if reason is not None:
            raise ValueError(f"cannot render scene {scene.name!r} from {pose}: the camera is {reason}")
        return self.render_mesh(scene.mesh, pose)

    def render_mesh(self, mesh: Mesh, pose: CameraPose) -> Rendered:
        """Render any mesh from any pose, with no room check (tests, object-only views)."""
        with torch.no_grad():
            return rasterize(self._device_mesh(mesh), pose, size=self.size, fov_deg=self.fov_deg,
                             near=self.near_m, shading=self.shading)

    def render(self, scene: MeshScene, pose: CameraPose) -> Image.Image:
        return self.render_buffers(scene, pose).image()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class CachedRenderer:
    """Renders through `renderer`, cached by (scene.name, quantized(pose), size) in an LRU
    bounded by `max_entries` and `max_bytes`. The pose is checked as given, then snapped
    before rendering, so two poses within a grid step give the very same view (unless the
    snapped pose is itself refused, as within a wall's margin: then the pose is rendered).
    Cached arrays are read-only (they are shared between callers)."""

    renderer: MeshRenderer
    max_entries: int = 4096
    max_bytes: int = 256 * 2**20
    step_m: float = 0.1
    step_deg: float = 5.0
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self._entries: OrderedDict[tuple, Rendered] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return self.renderer.size

    def __len__(self) -> int:
        return len(self._entries)

    def render_buffers(self, scene: MeshScene, pose: CameraPose) -> Rendered:
        snapped = quantized(pose, self.step_m, self.step_deg)
        key = (scene.name, snapped, self.renderer.size)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                return hit
        reason = scene.check_pose(pose)
        if reason is not None:
            raise ValueError(f"cannot render scene {scene.name!r} from {pose}: the camera is {reason}")
        # The snapped pose is rendered, so that a key means one image whichever pose came
        # first; where snapping lands inside a margin (a free pose near a wall), the pose
        # itself is rendered instead.
        view = snapped if scene.check_pose(snapped) is None else pose
        rendered = self.renderer.render_mesh(scene.mesh, view)  # outside the lock: slow
        for array in (rendered.rgb_HW3, rendered.depth_HW, rendered.object_id_HW):
            array.setflags(write=False)
        with self._lock:
            self.stats.misses += 1
            if key not in self._entries:
                self._entries[key] = rendered
                self._bytes += rendered.nbytes
            while self._entries and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
                self.stats.evictions += 1
        return rendered

    def render(self, scene: MeshScene, pose: CameraPose) -> Image.Image:
        return self.render_buffers(scene, pose).image()


def object_pixel_fraction(rendered: Rendered, object_id: int) -> float:
    """Fraction of the image's pixels that show the object (0 when it is out of view)."""
    return float((rendered.object_id_HW == object_id).mean())


def visible_fraction(renderer: MeshRenderer, scene: MeshScene, pose: CameraPose, object_id: int,
                     rendered: Rendered | None = None) -> float:
    """Fraction of the object's pixels in this view that are not hidden by something else:
    its pixels in the full render over its pixels when rendered alone. Parts outside the
    image count for neither; 0.0 when the object projects to no pixel. Costs one render of
    the object alone (small) besides the full one (pass `rendered` to reuse it)."""
    rendered = renderer.render_buffers(scene, pose) if rendered is None else rendered
    mesh = scene.mesh
    faces_F3 = mesh.faces_F3[face_object_ids(mesh) == object_id]
    alone = renderer.render_mesh(Mesh(mesh.vertices_V3, faces_F3, mesh.colors_V3, mesh.object_ids_V), pose)
    projected = int((alone.object_id_HW == object_id).sum())
    return float((rendered.object_id_HW == object_id).sum()) / projected if projected else 0.0
