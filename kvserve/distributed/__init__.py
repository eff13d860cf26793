"""Process groups, the tensor-parallel state and its collectives (gloo on CPU, NCCL on CUDA)."""
