"""FedSEPT (federated prompt tuning of CLIP) and its six prompt-tuning baselines."""
