# The native CPU backend (_sgrnn_cpu) and its BLAS, included by CMakeLists.txt.

# The BLAS (csrc/cpu/blas.h): Accelerate on macOS; elsewhere OpenBLAS from the
# scipy-openblas32 wheel, a build made to be linked by Python extensions.
if(APPLE)
  find_library(BLAS_LIBRARY Accelerate REQUIRED)
  set(BLAS_INCLUDE_DIR "")
else()
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import scipy_openblas32 as s; print(s.get_include_dir()); print(s.get_lib_dir())"
    OUTPUT_VARIABLE OPENBLAS_DIRS OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
  string(REPLACE "\n" ";" OPENBLAS_DIRS "${OPENBLAS_DIRS}")
  list(GET OPENBLAS_DIRS 0 BLAS_INCLUDE_DIR)
  list(GET OPENBLAS_DIRS 1 OPENBLAS_LIB_DIR)
  find_library(BLAS_LIBRARY NAMES scipy_openblas PATHS "${OPENBLAS_LIB_DIR}" NO_DEFAULT_PATH
               REQUIRED)
endif()
message(STATUS "BLAS: ${BLAS_LIBRARY}")

# ---------------------------------------------------------------- the kernels and the module
# kernels.cc once per instruction set; dispatch.cc chooses at run time (see kernels.h).
set(SGRNN_ISAS baseline)
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$" AND NOT APPLE)
  set(SGRNN_ISAS baseline x86_64_v3 x86_64_v4)
endif()
set(SGRNN_KERNEL_OBJECTS)
foreach(isa IN LISTS SGRNN_ISAS)
  add_library(sgrnn_kernels_${isa} OBJECT csrc/cpu/kernels.cc)
  target_include_directories(sgrnn_kernels_${isa} PRIVATE csrc ${BLAS_INCLUDE_DIR})
  target_compile_definitions(sgrnn_kernels_${isa} PRIVATE SGRNN_ISA=${isa})
  # -fno-trapping-math: the activation loops select between values computed unconditionally
  # (core.h); without it GCC keeps the selects as branches wherever the ISA lacks AVX-512's
  # masks, so on AVX2 and SSE2 tanh, sigmoid and their derivatives ran unvectorised. It only
  # assumes no code inspects floating-point exception flags (none does); results are the same.
  target_compile_options(sgrnn_kernels_${isa} PRIVATE -O3 -Wall -Wextra -fno-trapping-math)
  if(NOT isa STREQUAL "baseline")
    string(REPLACE "_" "-" march "${isa}")
    target_compile_options(sgrnn_kernels_${isa} PRIVATE -march=${march})
    # clang's x86-64-v4 tuning prefers 256-bit vectors and splits even the kernels' 512-bit
    # vector types into ymm halves; GCC's already uses zmm.
    if(isa STREQUAL "x86_64_v4" AND CMAKE_CXX_COMPILER_ID MATCHES "Clang")
      target_compile_options(sgrnn_kernels_${isa} PRIVATE -mprefer-vector-width=512)
    endif()
  endif()
  list(APPEND SGRNN_KERNEL_OBJECTS $<TARGET_OBJECTS:sgrnn_kernels_${isa}>)
endforeach()

pybind11_add_module(_sgrnn_cpu csrc/cpu/module.cc csrc/cpu/ffi_cpu.cc csrc/cpu/dispatch.cc
                    ${SGRNN_KERNEL_OBJECTS})
target_include_directories(_sgrnn_cpu PRIVATE ${BLAS_INCLUDE_DIR})
target_link_libraries(_sgrnn_cpu PRIVATE sgrnn_common "${BLAS_LIBRARY}")
target_compile_options(_sgrnn_cpu PRIVATE -O3 -Wall -Wextra)
if(SGRNN_ISAS MATCHES "x86_64_v4")
  target_compile_definitions(_sgrnn_cpu PRIVATE SGRNN_X86_ISAS)
  # The linker keeps one copy of each function with vague linkage (inline functions,
  # template instantiations) for the whole module, possibly an AVX-512 one, run on any CPU.
  # The kernels keep theirs inside their own ISA namespace; this check fails the build if a
  # non-baseline object defines one outside it whose code differs from the baseline's.
  add_custom_command(
    TARGET _sgrnn_cpu PRE_LINK
    COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_SOURCE_DIR}/cmake/check_isa_symbols.py"
            x86_64_v3 "$<TARGET_OBJECTS:sgrnn_kernels_baseline>"
            "$<TARGET_OBJECTS:sgrnn_kernels_x86_64_v3>"
    COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_SOURCE_DIR}/cmake/check_isa_symbols.py"
            x86_64_v4 "$<TARGET_OBJECTS:sgrnn_kernels_baseline>"
            "$<TARGET_OBJECTS:sgrnn_kernels_x86_64_v4>"
    VERBATIM)
endif()
if(NOT APPLE)
  # Installed next to site-packages/scipy_openblas32, whatever the build environment was.
  set_target_properties(_sgrnn_cpu PROPERTIES INSTALL_RPATH "$ORIGIN/../scipy_openblas32/lib"
                                              BUILD_WITH_INSTALL_RPATH ON)
endif()
sgrnn_export_entry_point_only(_sgrnn_cpu)
install(TARGETS _sgrnn_cpu LIBRARY DESTINATION jax_sgrnn)
