"""How good and how risky a synthetic table is: disclosure risk, DCR/NNDR, utility metrics."""
