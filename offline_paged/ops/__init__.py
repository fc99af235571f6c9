"""Array ops below the model: the NumPy reference ops and attention, and the Python that builds and launches the CUDA kernels (sources in the repo's cuda/, installed as offline_paged.kernels)."""
