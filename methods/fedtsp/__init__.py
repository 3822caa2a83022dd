"""FedTSP (text-semantic prototypes) and its heterogeneous-model and GFL/PFL baselines."""
