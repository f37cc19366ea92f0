"""Does a plan keep its promises: simulation, predicted vs measured, calibration."""
