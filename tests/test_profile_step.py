"""benchmarks/profile_step.py reads MindSpore's CPU profiler output: per kernel type, scope and custom kernel sums,
matmul share."""
from benchmarks.profile_step import MS_MATMULS, op_table, parse_ms_timestamps

LINES = [  # the format of FRAMEWORK/cpu_op_execute_timestamp_0.txt (MindSpore 2.9), two profiled steps
    "Default/loss_net-CausalLMLoss/model-Llama/MatMul-op12;HostCpuOps;1796074937645629462,3.0,0 1796074941124586319,5.0,0 \n",
    "Gradients/Default/loss_net-CausalLMLoss/MatMul-op40;HostCpuOps;1796074937645317597,6.0,0\n",
    "Default/update-ClipAndUpdate/optimizer-AdamW/Mul-op149;HostCpuOps;1796074937645291699,1.5,0 1796074941124268435,0.5,0\n",
    "Expand/_SoftmaxBackward/Mul-op3;HostCpuOps;1796074937878972050,2.0,0\n",
    "Default/TensorMove-op289;HostCpuOps;1796074937878972050,2.0,0\n",
    "Default/loss_net-CausalLMLoss/model-Llama/layers-CellList/0-DecoderLayer/attention-Attention/core-FusedAttention/"
    "Custom-op7;HostCpuOps;1796074937645629462,4.0,0\n",
    "Default/loss_net-CausalLMLoss/model-Llama/layers-CellList/1-DecoderLayer/attention-Attention/core-FusedAttention/"
    "Custom-op9;HostCpuOps;1796074937645629462,3.0,0\n",
    "Gradients/Default/loss_net-CausalLMLoss/model-Llama/layers-CellList/0-DecoderLayer/attention-Attention/"
    "core-FusedAttention/Grad_Custom/Custom-op50;HostCpuOps;1796074937645629462,9.0,0\n",
    "Default/update-ClipAndUpdate/Custom-op75;HostCpuOps;1796074937645629462,1.0,0 1796074941124268435,1.5,0\n",
    "Default/loss_net-CausalLMLoss/model-Llama/lm_head-Linear/rows-LinearKernel/Custom-op80;HostCpuOps;"
    "1796074937645629462,10.0,0\n",
    "Gradients/Default/loss_net-CausalLMLoss/model-Llama/lm_head-Linear/rows-LinearKernel/Grad_Custom/"
    "Custom-op81;HostCpuOps;1796074937645629462,20.0,0\n",
    "\n",
]


def test_sums_per_kernel_type_and_scope():
    by_type, by_scope, by_custom = parse_ms_timestamps(LINES)
    # the Linear's sgemm kernel is a type of its own: a GEMM, not one of the other custom kernels
    assert by_type == {"MatMul": 14.0, "Mul": 4.0, "TensorMove": 2.0, "Custom": 18.5, "Custom (LinearKernel)": 30.0}
    assert by_scope == {"forward (+ loss)": 25.0, "backward": 37.0, "optimizer (clip + AdamW)": 4.5,
                        "other (Default/TensorMove)": 2.0}
    # custom kernels by the cell that calls them and their scope, all layers together
    assert by_custom == {"FusedAttention, forward": 7.0, "FusedAttention, backward": 9.0,
                         "ClipAndUpdate, optimizer": 2.5, "LinearKernel, forward": 10.0, "LinearKernel, backward": 20.0}


def test_matmul_share_is_the_matmul_kernels_over_all_kernel_time():
    text, share = op_table({"MatMul": 14.0, "BatchMatMul": 1.0, "Mul": 4.0, "TensorMove": 1.0}, MS_MATMULS, top=2)
    assert share == 15.0 / 20.0
    assert "(2 more)" in text and text.splitlines()[1].startswith("MatMul")
    _, share = op_table({"Custom (LinearKernel)": 30.0, "MatMul": 10.0, "Custom": 10.0}, MS_MATMULS)
    assert share == 40.0 / 50.0
