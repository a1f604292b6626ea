"""2D tensor parallelism (MeshSlice): the cost model of sliced 2D GEMMs and their baselines on an
R x C mesh, and the tuner that picks each FC layer's dataflow, the mesh shape and the slice counts."""
