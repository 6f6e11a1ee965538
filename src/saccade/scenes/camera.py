"""Camera poses in a Z-up world (metres), and the matrices that go with them.

Yaw 0 looks along +x; positive yaw turns left (counter-clockwise seen from above, towards
+y). Pitch is positive looking up and is clamped to [-80, 80] degrees: straight up or down
the camera's "up" is undefined, and an agent gains nothing from those views that it cannot
get at 80.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PITCH_LIMIT_DEG = 80.0


@dataclass(frozen=True)
class CameraPose:
    x: float
    y: float
    z: float
    yaw_deg: float = 0.0
    pitch_deg: float = 0.0

    def __post_init__(self) -> None:
        for name in ("x", "y", "z", "yaw_deg", "pitch_deg"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"CameraPose.{name} must be a finite number, got {getattr(self, name)!r}")
        # Normalise so that equal views compare (and cache) equal: yaw in [-180, 180).
        object.__setattr__(self, "yaw_deg", (float(self.yaw_deg) + 180.0) % 360.0 - 180.0)
        object.__setattr__(self, "pitch_deg", float(min(PITCH_LIMIT_DEG, max(-PITCH_LIMIT_DEG, self.pitch_deg))))

    @property
    def position(self) -> tuple[float, float, float]:
        return (self.x, self.y, self.z)


def camera_axes(pose: CameraPose) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(right, up, forward) unit vectors of the camera in world coordinates (float64)."""
    yaw, pitch = math.radians(pose.yaw_deg), math.radians(pose.pitch_deg)
    forward = np.array([math.cos(pitch) * math.cos(yaw), math.cos(pitch) * math.sin(yaw), math.sin(pitch)])
    right = np.array([math.sin(yaw), -math.cos(yaw), 0.0])  # level: pitch never reaches 90
    up = np.cross(right, forward)
    return right, up, forward


def forward_vector(pose: CameraPose) -> np.ndarray:
    """The unit vector the camera looks along, shape (3,)."""
    return camera_axes(pose)[2]


def view_matrix(pose: CameraPose) -> np.ndarray:
    """World -> camera, 4x4 float64, OpenGL convention: the camera looks along its -z, x is
    right, y is up. A point p_world maps to `view_matrix(pose) @ [*p_world, 1]`; its depth in
    front of the camera is minus the resulting z."""
    right, up, forward = camera_axes(pose)
    rotation_33 = np.stack([right, up, -forward])
    view_44 = np.eye(4)
    view_44[:3, :3] = rotation_33
    view_44[:3, 3] = -rotation_33 @ np.array(pose.position)
    return view_44


def quantized(pose: CameraPose, step_m: float = 0.1, step_deg: float = 5.0) -> CameraPose:
    """The pose snapped to a grid (cache keys): positions to `step_m`, angles to `step_deg`.
    Values are rounded to 6 decimals after snapping so that float noise gives one key."""
    if step_m <= 0 or step_deg <= 0:
        raise ValueError(f"quantized: steps must be positive, got step_m={step_m}, step_deg={step_deg}")

    def snap(value: float, step: float) -> float:
        return round(round(value / step) * step, 6)

    return CameraPose(snap(pose.x, step_m), snap(pose.y, step_m), snap(pose.z, step_m),
                      snap(pose.yaw_deg, step_deg), snap(pose.pitch_deg, step_deg))
