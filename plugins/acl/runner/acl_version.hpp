// The ACL release the runner is compiled for: build.py reads it from the library it links
// (arm_compute_version=vYY.MM) and passes KSELECT_ACL_VERSION_MAJOR / _MINOR. The runner is written
// for two APIs: 20.08's (Debian 12) and 24.11's (Debian 13).
#pragma once

#if !defined(KSELECT_ACL_VERSION_MAJOR) || !defined(KSELECT_ACL_VERSION_MINOR)
#error "build the runner with build.py: it passes -DKSELECT_ACL_VERSION_MAJOR=.. -DKSELECT_ACL_VERSION_MINOR=.."
#endif

// 24.11: IScheduler::schedule_op takes the window to run; NEGEMMConvolutionLayer takes
// enable_fast_math before num_groups; ConvolutionMethod adds GEMM_CONV2D and INDIRECT.
#define KS_ACL_24 (KSELECT_ACL_VERSION_MAJOR >= 24)
// CPUInfo::set_cpu_model (the cpu_model hint) exists in 20.08 only: later CPUInfo is read-only.
#define KS_ACL_CPU_MODEL_HINT (KSELECT_ACL_VERSION_MAJOR == 20)
// The arm_gemm declarations of gemm_forcing.cpp follow the ABIs of 20.08 and 24.11 exactly (not
// shipped as headers); on any other release GEMM kernel forcing is compiled out.
#define KS_ACL_GEMM_ABI_20_08 (KSELECT_ACL_VERSION_MAJOR == 20 && KSELECT_ACL_VERSION_MINOR == 8)
#define KS_ACL_GEMM_ABI_24_11 (KSELECT_ACL_VERSION_MAJOR == 24 && KSELECT_ACL_VERSION_MINOR == 11)
#define KS_ACL_GEMM_FORCING_ABI (KS_ACL_GEMM_ABI_20_08 || KS_ACL_GEMM_ABI_24_11)
