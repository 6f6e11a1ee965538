"""What sits above the library and measures or drives it: the benchmarks, the demos, the doctor,
the memory estimator, the parity check, export, the report and plots, and the launcher. The
library never imports a tool (tests/test_imports.py)."""
