# Gloo's headers, which parallel/ needs and a LibTorch wheel does not ship (Debian's libgloo-dev).
find_path(TRAINKIT_GLOO_INCLUDE_DIR gloo/algorithm.h DOC "Gloo's headers (for trainkit/parallel/)")

# trainkit_add_compiled(<trainkit target> <trainkit.cpp>): the static library trainkit_compiled
# (alias trainkit::compiled), outside `all`: trainkit's compiled mode (docs/design/
# compiled-mode.md). It compiles the non-template definitions of the -inl.hpp files once, in
# src/trainkit.cpp, and gives its users TRAINKIT_COMPILED_LIB, so that their own files see the
# declarations alone and compile in less time. Every file of a program is built in one mode: link
# trainkit::compiled to the program (trainkit::registry links it for its users). Used by trainkit's
# own CMakeLists.txt and by the installed package (on the installed source), so that an install
# stays header-only and independent of the compiler's ABI.
function(trainkit_add_compiled trainkit_target source)
  if(TARGET trainkit_compiled)
    return()
  endif()
  add_library(trainkit_compiled STATIC EXCLUDE_FROM_ALL "${source}")
  add_library(trainkit::compiled ALIAS trainkit_compiled)
  target_link_libraries(trainkit_compiled PUBLIC ${trainkit_target})
  target_compile_definitions(trainkit_compiled PUBLIC TRAINKIT_COMPILED_LIB)
  # The parallel/ layer too where Gloo's headers are found (a LibTorch wheel does not ship them;
  # Debian's libgloo-dev does): its users get TRAINKIT_COMPILED_PARALLEL (detail/inline.hpp).
  # Otherwise ProcessGroup and DataParallel stay header-only in a compiled program.
  if(TRAINKIT_GLOO_INCLUDE_DIR)
    target_compile_definitions(trainkit_compiled PUBLIC TRAINKIT_COMPILED_PARALLEL)
    target_include_directories(trainkit_compiled SYSTEM PUBLIC "${TRAINKIT_GLOO_INCLUDE_DIR}")
  endif()
endfunction()

# trainkit_add_precompiled(<trainkit target>): the INTERFACE target trainkit_precompiled (alias
# trainkit::precompiled). A target that links it precompiles <torch/torch.h> and trainkit's
# headers (the umbrella, and parallel/data_parallel.hpp where Gloo's headers are found) once, in
# its own build, and every one of its files then starts from that header: an edit recompiles
# the file's own code only. Each of the target's files sees those headers as if it included
# them first. Link it with trainkit::compiled (or trainkit::registry): the precompiled header is
# built in the target's own mode and flags.
function(trainkit_add_precompiled trainkit_target)
  if(TARGET trainkit_precompiled)
    return()
  endif()
  add_library(trainkit_precompiled INTERFACE)
  add_library(trainkit::precompiled ALIAS trainkit_precompiled)
  target_link_libraries(trainkit_precompiled INTERFACE ${trainkit_target})
  set(_headers <torch/torch.h> <trainkit/trainkit.hpp>)
  if(TRAINKIT_GLOO_INCLUDE_DIR)
    list(APPEND _headers <trainkit/parallel/data_parallel.hpp>)
    target_include_directories(trainkit_precompiled SYSTEM INTERFACE "${TRAINKIT_GLOO_INCLUDE_DIR}")
  endif()
  # (C++ files only: a C file of the same target gets none)
  list(TRANSFORM _headers PREPEND "$<$<COMPILE_LANGUAGE:CXX>:")
  list(TRANSFORM _headers APPEND ">")
  target_precompile_headers(trainkit_precompiled INTERFACE ${_headers})
endfunction()
