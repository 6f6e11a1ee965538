import numpy as np
import pytest

from saccade.scenes.camera import CameraPose, forward_vector, quantized, view_matrix


def test_yaw_zero_looks_along_x_and_positive_yaw_turns_left():
    np.testing.assert_allclose(forward_vector(CameraPose(0, 0, 0)), [1, 0, 0], atol=1e-12)
    np.testing.assert_allclose(forward_vector(CameraPose(0, 0, 0, yaw_deg=90)), [0, 1, 0], atol=1e-12)
    np.testing.assert_allclose(forward_vector(CameraPose(0, 0, 0, pitch_deg=30)),
                               [np.cos(np.pi / 6), 0, 0.5], atol=1e-12)


def test_pitch_is_clamped_and_yaw_wrapped():
    pose = CameraPose(0, 0, 0, yaw_deg=270, pitch_deg=95)
    assert pose.pitch_deg == 80 and pose.yaw_deg == -90


def test_view_matrix_puts_a_point_ahead_at_minus_z():
    pose = CameraPose(1, 2, 1.5, yaw_deg=90)
    ahead = view_matrix(pose) @ np.array([1, 5, 1.5, 1])  # 3 m along +y
    np.testing.assert_allclose(ahead[:3], [0, 0, -3], atol=1e-12)


def test_quantized_snaps_to_the_grid():
    assert quantized(CameraPose(1.04, 0.96, 1.5, 2.4, -2.6)) == CameraPose(1.0, 1.0, 1.5, 0.0, -5.0)
    with pytest.raises(ValueError, match="positive"):
        quantized(CameraPose(0, 0, 0), step_m=0)
