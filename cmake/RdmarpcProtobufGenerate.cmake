# rdmarpc_protobuf_generate(TARGET <target> PROTOS <a.proto>... [IMPORT_DIRS <dir>...]
#                           [OUT_DIR <dir>] [MOCKS])
#
# Runs protoc with the C++ generator and protoc-gen-rdmarpc on each .proto and
# adds the generated X.pb.{h,cc} and X.rdmarpc.pb.{h,cc} to <target>, whose
# users then see the generated headers. A .proto's path relative to the first
# IMPORT_DIR that holds it decides the generated names (as with protoc -I);
# by default the import dir is the directory of the .proto. MOCKS also
# generates X_mock.rdmarpc.pb.h with a gmock Mock<Service>Stub per service (its
# users link GTest::gmock themselves).
function(rdmarpc_protobuf_generate)
  cmake_parse_arguments(ARG "MOCKS" "TARGET;OUT_DIR" "PROTOS;IMPORT_DIRS" ${ARGN})
  if(NOT ARG_TARGET OR NOT ARG_PROTOS)
    message(FATAL_ERROR "rdmarpc_protobuf_generate: TARGET and PROTOS are required")
  endif()
  if(NOT ARG_OUT_DIR)
    set(ARG_OUT_DIR ${CMAKE_CURRENT_BINARY_DIR}/rdmarpc_gen)
  endif()
  file(MAKE_DIRECTORY ${ARG_OUT_DIR})
  if(TARGET protobuf::protoc)
    set(protoc $<TARGET_FILE:protobuf::protoc>)
  else()
    set(protoc ${Protobuf_PROTOC_EXECUTABLE})
  endif()
  set(plugin $<TARGET_FILE:rdmarpc::protoc_plugin>)

  set(import_flags)
  foreach(dir IN LISTS ARG_IMPORT_DIRS)
    get_filename_component(abs ${dir} ABSOLUTE)
    list(APPEND import_flags -I${abs})
  endforeach()

  set(outputs)
  foreach(proto IN LISTS ARG_PROTOS)
    get_filename_component(abs ${proto} ABSOLUTE)
    set(rel)
    foreach(dir IN LISTS ARG_IMPORT_DIRS)
      get_filename_component(absdir ${dir} ABSOLUTE)
      file(RELATIVE_PATH candidate ${absdir} ${abs})
      if(NOT candidate MATCHES "^\\.\\./" AND NOT rel)
        set(rel ${candidate})
      endif()
    endforeach()
    set(flags ${import_flags})
    if(NOT rel)
      get_filename_component(dir ${abs} DIRECTORY)
      get_filename_component(rel ${abs} NAME)
      list(APPEND flags -I${dir})
    endif()
    string(REGEX REPLACE "\\.proto$" "" stem ${rel})
    set(gen ${ARG_OUT_DIR}/${stem}.pb.h ${ARG_OUT_DIR}/${stem}.pb.cc
            ${ARG_OUT_DIR}/${stem}.rdmarpc.pb.h ${ARG_OUT_DIR}/${stem}.rdmarpc.pb.cc)
    set(rdmarpc_opts "")
    if(ARG_MOCKS)
      set(rdmarpc_opts "mocks:")
      list(APPEND gen ${ARG_OUT_DIR}/${stem}_mock.rdmarpc.pb.h)
    endif()
    add_custom_command(
      OUTPUT ${gen}
      COMMAND ${protoc} ${flags} --cpp_out=${ARG_OUT_DIR}
              --plugin=protoc-gen-rdmarpc=${plugin} --rdmarpc_out=${rdmarpc_opts}${ARG_OUT_DIR} ${abs}
      DEPENDS ${abs} rdmarpc::protoc_plugin
      COMMENT "rdmarpc: generating code for ${rel}"
      VERBATIM)
    list(APPEND outputs ${gen})
  endforeach()
  target_sources(${ARG_TARGET} PRIVATE ${outputs})
  target_include_directories(${ARG_TARGET} PUBLIC $<BUILD_INTERFACE:${ARG_OUT_DIR}>)
  target_link_libraries(${ARG_TARGET} PUBLIC rdmarpc::rdmarpc protobuf::libprotobuf)
endfunction()
