// Package v20170312 has the part of Tencent Cloud's VPC client that flannel's tencent-vpc
// backend uses, and no client: see go.mod.
package v20170312

import "errors"

var errNotBuilt = errors.New("flannel's tencent-vpc backend is not built into detour's test flanneld: use vxlan or host-gw")

type Filter struct {
	Name   *string
	Values []*string
}

type Route struct {
	DestinationCidrBlock *string
	GatewayType          *string
	GatewayId            *string
	RouteType            *string
	RouteId              *uint64
	Enabled              *bool
}

type RouteTable struct {
	RouteTableId *string
	RouteSet     []*Route
}

type DescribeRouteTablesRequest struct{ Filters []*Filter }

type DescribeRouteTablesResponse struct {
	Response *struct{ RouteTableSet []*RouteTable }
}

type RoutesRequest struct {
	RouteTableId *string
	Routes       []*Route
}

type (
	CreateRoutesRequest = RoutesRequest
	DeleteRoutesRequest = RoutesRequest
)

type RoutesResponse struct{}

func NewDescribeRouteTablesRequest() *DescribeRouteTablesRequest {
	return &DescribeRouteTablesRequest{}
}
func NewCreateRoutesRequest() *CreateRoutesRequest { return &CreateRoutesRequest{} }
func NewDeleteRoutesRequest() *DeleteRoutesRequest { return &DeleteRoutesRequest{} }

// Client fails every call.
type Client struct{}

func NewClientWithSecretId(secretID, secretKey, region string) (*Client, error) {
	return nil, errNotBuilt
}

func (*Client) DescribeRouteTables(*DescribeRouteTablesRequest) (*DescribeRouteTablesResponse, error) {
	return nil, errNotBuilt
}
func (*Client) CreateRoutes(*CreateRoutesRequest) (*RoutesResponse, error) { return nil, errNotBuilt }
func (*Client) DeleteRoutes(*DeleteRoutesRequest) (*RoutesResponse, error) { return nil, errNotBuilt }
