"""The language-model role (aggregated, or the PD side of E+PD): its HTTP service over an engine core."""
