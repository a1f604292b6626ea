"""Schedule choice: cost model (model.py), machine parameters (calibration.py), cache."""
