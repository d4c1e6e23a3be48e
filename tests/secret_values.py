"""Secret-looking environment variables no stored byte may hold, and allow-listed ones a row keeps: shared by
tests/unit/test_security.py and tests/integration/test_security_runs.py."""

SECRETS = {"NCCL_IB_TOKEN": "tok-123", "AWS_SECRET_ACCESS_KEY": "aws-456", "HF_TOKEN": "hf_789",
           "CUDA_API_KEY": "cuda-000", "TORCH_PASSWORD": "pw-111", "RAY_AUTH_TOKEN": "ray-222",
           "NCCL_CREDENTIALS": "cred-333"}
SAFE = {"NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0,1", "OMP_NUM_THREADS": "4"}
