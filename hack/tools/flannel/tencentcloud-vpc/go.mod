// A stand-in for Tencent Cloud's VPC client, which the Go module proxy these machines use does
// not serve: flanneld's main imports every backend, tencent-vpc among them. The e2e's flannel
// runs the vxlan backend, so nothing calls it; every call fails. hack/tools/flannel/go.mod
// replaces the real module with this one.
module github.com/tencentcloud/tencentcloud-sdk-go/tencentcloud/vpc

go 1.26.8
