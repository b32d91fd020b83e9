from setuptools import find_packages, setup

setup(
    name="torchrec-neuroshard",
    version="0.1.0",
    description=(
        "NeuroShard embedding-table sharding planner for TorchRec: pre-trained neural "
        "cost models plus beam/grid search"
    ),
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torchrec_neuroshard", "torchrec_neuroshard.*"]),
    # the shipped models and UVM pricing; the lab's measured datasets (lab/data) stay in the repository:
    # nothing reads them at run time (`make model` re-trains from them)
    package_data={"torchrec_neuroshard": ["pretrained/*.pt", "pretrained/*.json"]},
    python_requires=">=3.10",
    # torch / fbgemm-gpu / torchrec are installed by the Makefile: torchrec's metadata
    # pins the CUDA fbgemm-gpu wheel, so it is installed with --no-deps (see README).
    install_requires=["numpy", "scipy", "tqdm", "threadpoolctl"],
    entry_points={"console_scripts": ["neuroshard = torchrec_neuroshard.cli:main"]},
)
