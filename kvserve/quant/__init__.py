"""KV-cache quantization tooling: calibration scales files, `kvserve calibrate` and `kvserve eval`."""
