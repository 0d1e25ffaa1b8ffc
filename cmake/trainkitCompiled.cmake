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
endfunction()
