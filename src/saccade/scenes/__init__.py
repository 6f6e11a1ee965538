"""Indoor mesh scenes for view selection: what a scene is, where a camera may stand, and
how a view of it is rendered.

- `mesh`: `Mesh` (vertex-coloured triangles, object id per vertex), `SceneObject`,
  `MeshScene` (with `check_pose`), the colour palette `SCENE_COLORS`.
- `camera`: `CameraPose` (x, y, z, yaw, pitch; Z up) and its matrices.
- `render`: `MeshRenderer` (a PyTorch z-buffer rasterizer, CPU or CUDA), `CachedRenderer`,
  `Rendered` buffers (rgb, depth, object id) and the view-quality measures.
- `generate`: procedural rooms with labelled furniture and small objects, and
  `write_scannet_layout` to save one as a ScanNet scene folder.
- `loaders`: ScanNet folders, ARKitScenes meshes, any .ply/.obj/.glb; `load_scene` picks one.

docs/scenes.md says why the renderer is our own and how fast it is.
"""
