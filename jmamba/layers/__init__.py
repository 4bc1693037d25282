"""Small building blocks shared by the Mamba-1 and Mamba-3 layers."""
