"""The benchmark harness behind ``marlaas bench``: workloads (``workload``), runs of the
stack under each schedule (``runner``), figures from spans (``metrics``), the markdown
report with targets (``report``) and the plots (``plots``)."""
