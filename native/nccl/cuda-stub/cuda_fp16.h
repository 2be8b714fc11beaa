/* Empty: nccl.h includes it, but no NCCL host API uses the half type. */
